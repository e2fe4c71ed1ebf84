"""The hang watchdog on 3 gloo ranks: a stopped rank is named by the others within hang_timeout_s,
a killed one (or one that reported its failure) is named when their collective fails."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from epdraft.errors import ParallelError
from epdraft.parallel.spawn import run_local_ranks

HANG_S = 2.0


def _stopped_rank(rank: int, world: int) -> tuple[list[str], float]:
    import faulthandler

    import torch.distributed as dist

    from epdraft.parallel.watchdog import Watchdog

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # what the worker does: SIGUSR1 prints, not kills
    stalls: list[str] = []
    wd = Watchdog.start_for(dist.group.WORLD, hang_timeout_s=HANG_S, stacks_on_usr1=True, on_stall=stalls.append)
    wd.progress(7, "verify")
    time.sleep(3 * wd.interval_s)  # every rank has beaten with step 7
    start = time.monotonic()
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    # Rank 2 joins only once a peer's watchdog named it and sent it SIGCONT (after its SIGUSR1);
    # the other peer may see it beat again before its own bound passes.
    dist.barrier()
    after_s = time.monotonic() - start
    time.sleep(2 * wd.interval_s)
    wd.stop()
    assert not wd._thread.is_alive()
    return stalls, after_s


@pytest.mark.timeout(120)
def test_a_stopped_rank_is_named_within_hang_timeout_and_resumed():
    results = run_local_ranks(3, _stopped_rank, timeout_s=90)
    messages = [m for stalls, _ in results[:2] for m in stalls]
    assert messages, "no rank named the stopped rank 2"
    for message in messages:
        assert message.startswith("rank 2 stalled: no heartbeat for "), message
        assert "last at step 7, phase verify" in message and "sent SIGUSR1 to its pid" in message, message
    assert results[2][0] == [], "rank 2 named a peer stalled after it ran again"
    assert all(after_s < HANG_S + 5 for _, after_s in results[:2]), results


def _peer_lost(rank: int, world: int, how: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from epdraft.parallel.watchdog import Watchdog

    wd = Watchdog.start_for(dist.group.WORLD, hang_timeout_s=20.0)
    wd.progress(3, "draft layer 1 MoE")
    time.sleep(2.5)  # every rank has beaten
    if rank == 2:
        if how == "failed":
            wd.fail("rank 2 at step 3: the draft refused its input")
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(1000):
            dist.all_reduce(torch.ones(4))
            time.sleep(0.01)
        message = "no collective failed"
    except RuntimeError as e:
        lost = wd.lost_error(e, what="the test's all-reduce")
        message = "lost_error returned None" if lost is None else str(lost)
        assert isinstance(lost, ParallelError) or lost is None
    wd.stop()
    Path(out, f"rank{rank}").write_text(message)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["killed", "failed"])
def test_a_collective_that_loses_a_peer_names_it(tmp_path, how):
    start = time.monotonic()
    with pytest.raises(ParallelError, match="rank 2 exited with code -9 without reporting"):
        run_local_ranks(3, _peer_lost, how, str(tmp_path), timeout_s=90, pg_timeout_s=60)
    assert time.monotonic() - start < 60
    for rank in (0, 1):
        message = (tmp_path / f"rank{rank}").read_text()
        if how == "killed":
            assert message.startswith("lost rank 2 (heartbeat gone, last at step 3, phase draft layer 1 MoE): "
                                      f"the test's all-reduce failed on rank {rank} at step 3"), message
        else:
            assert message.startswith("rank 2 failed at step 3, phase draft layer 1 MoE: rank 2 at step 3: "
                                      "the draft refused its input"), message
