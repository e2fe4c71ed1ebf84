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

    # as the worker does, SIGUSR1 prints rather than kills; this thread's stack only: a dump of every
    # thread reads the others' frames without a lock while they run again after the SIGCONT, which
    # crashed rank 2 (SIGSEGV) once in CI
    faulthandler.register(signal.SIGUSR1, all_threads=False)
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


def _all_reduce_until_lost(wd, out: str, rank: int) -> None:
    """All-reduce until a peer is lost, then write what `lost_error` names (or why not) to out/rank{rank}."""
    import torch
    import torch.distributed as dist

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


def _peer_lost(rank: int, world: int, how: str, out: str) -> None:
    import torch.distributed as dist

    from epdraft.parallel.watchdog import Watchdog

    wd = Watchdog.start_for(dist.group.WORLD, hang_timeout_s=20.0)
    wd.progress(3, "draft layer 1 MoE")
    time.sleep(2.5)  # every rank has beaten
    if rank == 2:
        if how == "failed":
            wd.fail("rank 2 at step 3: the draft refused its input")
        os.kill(os.getpid(), signal.SIGKILL)
    _all_reduce_until_lost(wd, out, rank)


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


class _RecordingStore:
    """A store that records the requests made through it and its clones (the watchdog clones it)."""

    def __init__(self, store, calls: list):
        self._store, self.calls = store, calls

    def clone(self):
        return _RecordingStore(self._store.clone(), self.calls)

    def set_timeout(self, timeout):
        self._store.set_timeout(timeout)

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def recorded(*args, **kwargs):
            self.calls.append(name)
            return method(*args, **kwargs)

        return recorded


def _startup_requests(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from epdraft.parallel.watchdog import Watchdog

    calls: list[str] = []
    store = _RecordingStore(dist.distributed_c10d._get_default_store(), calls)
    if rank == world - 1:
        time.sleep(2.0)  # the last rank starts two rounds late: its peers look for it meanwhile
    wd = Watchdog(store, range(world), rank=rank, hang_timeout_s=10.0)  # a round a second, none named
    wd.start()
    time.sleep(4.5)
    wd.stop()
    return calls


@pytest.mark.timeout(60)
def test_watchdog_store_requests_per_round_do_not_grow_with_the_world():
    world = 6
    for rank, calls in enumerate(run_local_ranks(world, _startup_requests, timeout_s=50)):
        # Each round beats (one set), then reads: at most one check (are all unseen peers there?)
        # and one multi-get. Asking peer by peer made W - 1 checks in a round, W(W - 1) in all.
        rounds = " ".join(calls).split("set")
        assert len(rounds) >= 4, (rank, calls)
        for requests in rounds:
            assert requests.split().count("check") <= 1 and requests.split().count("multi_get") <= 1, (rank, calls)
        assert "multi_get" in calls, (rank, calls)


def _stuck_main_thread(rank: int, world: int, stuck_s: float) -> tuple[list[str], float | None]:
    import torch.distributed as dist

    from epdraft.parallel.watchdog import Watchdog

    stalls: list[tuple[float, str]] = []
    wd = Watchdog.start_for(dist.group.WORLD, hang_timeout_s=HANG_S,
                            on_stall=lambda m: stalls.append((time.monotonic(), m)))  # fmt: skip
    wd.progress(3, "draft layer 0 MoE")
    dist.barrier()
    time.sleep(3 * wd.interval_s)
    start = time.monotonic()
    if rank == 1:
        time.sleep(stuck_s)  # the main thread is stuck; its heartbeat thread beats on
    dist.all_reduce(__import__("torch").ones(1))  # the peers wait here for it
    wd.stop()
    return [m for _, m in stalls], (stalls[0][0] - start if stalls else None)


@pytest.mark.timeout(90)
def test_a_stuck_main_thread_with_a_live_heartbeat_is_named_by_every_peer():
    stuck_s = HANG_S + 8
    results = run_local_ranks(4, _stuck_main_thread, stuck_s, timeout_s=80, pg_timeout_s=60)
    assert results[1][0] == [], "the stuck rank named a peer"
    for rank in (0, 2, 3):
        messages, after_s = results[rank]
        assert len(messages) == 1, (rank, messages)
        assert messages[0].startswith("rank 1 stuck: its heartbeat beats but its main thread has not moved "), messages
        assert "(last at step 3, phase draft layer 0 MoE, not in a collective)" in messages[0], messages
        assert "rank 0" not in messages[0].split("(cluster.")[0].replace(f"rank {rank} waits", ""), messages
        assert after_s is not None and after_s <= HANG_S + 10, (rank, after_s)


def _store_host_killed(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    from epdraft.parallel.watchdog import Watchdog

    wd = Watchdog.start_for(dist.group.WORLD, hang_timeout_s=20.0)
    wd.progress(4, "draft layer 1 MoE")
    time.sleep(2.5)  # every rank has beaten, and seen the others
    if rank == 0:  # run_local_ranks' rank 0 hosts the TCPStore of the tcp:// rendezvous
        os.kill(os.getpid(), signal.SIGKILL)
    _all_reduce_until_lost(wd, out, rank)


@pytest.mark.timeout(90)
def test_the_store_host_dying_is_named_alone(tmp_path):
    with pytest.raises(ParallelError, match="rank 0 exited with code -9 without reporting"):
        run_local_ranks(4, _store_host_killed, str(tmp_path), timeout_s=80, pg_timeout_s=60)
    for rank in (1, 2, 3):
        message = (tmp_path / f"rank{rank}").read_text()
        assert message.startswith("lost rank 0 (it hosted the rendezvous store, which stopped answering; "
                                  "last at step 4, phase draft layer 1 MoE): the test's all-reduce failed on "
                                  f"rank {rank} at step 4"), message
        assert "heartbeat gone" not in message, message


def _killed_right_after_reporting(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    from epdraft.parallel.watchdog import Watchdog

    wd = Watchdog.start_for(dist.group.WORLD, hang_timeout_s=20.0)  # beats every second ...
    time.sleep(2.5)
    wd.progress(9, "draft layer 2 MoE")  # ... so no periodic beat carries this before the kill
    if rank == 2:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    _all_reduce_until_lost(wd, out, rank)


@pytest.mark.timeout(90)
def test_a_killed_rank_is_named_with_the_step_and_phase_it_last_reported(tmp_path):
    with pytest.raises(ParallelError, match="rank 2 exited with code -9 without reporting"):
        run_local_ranks(3, _killed_right_after_reporting, str(tmp_path), timeout_s=80, pg_timeout_s=60)
    for rank in (0, 1):
        message = (tmp_path / f"rank{rank}").read_text()
        assert message.startswith("lost rank 2 (heartbeat gone, last at step 9, phase draft layer 2 MoE): "), message


def test_a_rank_blocked_in_a_point_to_point_wait_counts_as_waiting():
    """A paired rank blocked on its peer (a target still loading before its Hello): the watchdog
    reads the innermost Python frame of its main thread, and a Work's wait is C++, so that frame
    is `p2p.wait`'s, which must count as waiting on peers, not as stuck."""
    import functools
    import sys
    import threading

    from epdraft.parallel import p2p, watchdog

    class _Work:  # its wait, like a c10d Work's, runs no Python
        wait = functools.partial(time.sleep, 0.5)

    blocked = threading.Thread(target=p2p.wait, args=(_Work(), "a test"))
    blocked.start()
    time.sleep(0.2)
    frame = sys._current_frames()[blocked.ident]
    blocked.join()
    assert frame.f_code.co_filename == p2p.__file__ and frame.f_code.co_filename.startswith(watchdog._WAIT_FILES)
