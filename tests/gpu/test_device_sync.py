"""The step sync on GPU ranks (issue 33): `StepCoordinator` over an NCCL group exchanges
[step, rows, counts digest, *extras] through one device all-gather and returns the plan, and ranks passing
different step ids are refused. One GPU: a one-rank NCCL group (the multi-rank latency at EP 2
needs two GPUs); prints the median sync time, which bounds the exchange's own overhead."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from tests.harness import run_ranks

pytestmark = pytest.mark.gpu


def _device_sync(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from epdraft.parallel.exchange import DeviceExchange
    from epdraft.runtime.coordinator import StepCoordinator

    torch.cuda.set_device(0)
    nccl = dist.new_group([0], backend="nccl")
    coordinator = StepCoordinator(nccl, num_extras=1, device=torch.device("cuda", 0))
    assert isinstance(coordinator._exchange, DeviceExchange)
    plans = [coordinator.sync(step, 16 * step, (step + 7,)) for step in range(5)]
    times = []
    for step in range(5, 205):
        start = time.perf_counter()
        coordinator.sync(step, 32, (1,))
        times.append(time.perf_counter() - start)
    return {"plans": [(p.step, p.counts, p.extras) for p in plans], "median_us": 1e6 * statistics.median(times)}


def test_step_sync_through_one_nccl_all_gather():
    got = run_ranks(1, _device_sync, timeout_s=120)[0]
    assert got["plans"] == [(s, (16 * s,), ((s + 7,),)) for s in range(5)]
    print(f"one-rank NCCL step sync: {got['median_us']:.1f} us median over 200 syncs")
