"""PhaseTimers on CUDA: phases timed by events on the stream (no host sync per phase), nested
phases booked exclusively, so the phases sum to no more than the wall time around them."""

from __future__ import annotations

import time

import pytest
import torch

from epdraft.runtime.timing import PhaseTimers

pytestmark = pytest.mark.gpu


def _cycles_per_s() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm up
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / (start.elapsed_time(end) / 1000.0)


def test_cuda_phases_are_device_time_exclusive_and_never_sync_the_host():
    per_s = _cycles_per_s()
    sleep = lambda s: torch.cuda._sleep(int(s * per_s))  # noqa: E731  a kernel that runs s seconds
    timers = PhaseTimers("cuda")
    wall_start = timers.now()
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing call inside the phases raises
    try:
        with timers.phase("step"):
            sleep(0.02)
            with timers.phase("moe"):
                sleep(0.03)
            sleep(0.02)
        with timers.phase("moe"):
            sleep(0.01)
        host_enqueued = time.perf_counter() - wall_start
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = timers.as_dict()
    wall = timers.now() - wall_start
    assert host_enqueued < 0.02  # the host queued 80 ms of kernels without waiting for any
    assert got["step"] == pytest.approx(0.04, rel=0.1)
    assert got["moe"] == pytest.approx(0.04, rel=0.1)
    assert sum(got.values()) <= wall


def test_pending_events_are_read_without_a_sync_once_the_device_passed_them():
    timers = PhaseTimers("cuda")
    for _ in range(5000):  # past the pending limit: the finished spans are booked as it goes
        with timers.phase("tiny"):
            torch.cuda._sleep(100)
    assert len(timers._pending) <= 4097
    assert timers.as_dict()["tiny"] > 0
    assert timers._pending == []
