"""Run a function on N local ranks with a deadline: the one spawner for tests and benchmarks.

Each rank is a spawned process (fresh interpreter, no forked CUDA or thread state) that joins a gloo
(CPU) or NCCL (rank r on cuda:r) world on 127.0.0.1 at a free port, calls `fn(rank, world, ...)` and
sends its result, or its traceback as text, back through a queue. A rank still running at the deadline is killed, so a hang
ends as a `ParallelError` naming the rank instead of a stuck job.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
import traceback
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from epdraft.errors import ParallelError
from epdraft.parallel.world import join_world, leave_world

log = logging.getLogger(__name__)

_POLL_S = 0.05
_EXIT_GRACE_S = 5.0  # how long a rank that reported may take to tear down its group before it is killed
BACKENDS = ("gloo", "nccl")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it, so parallel runs don't collide)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    rank: int,
    world: int,
    port: int,
    pg_timeout_s: float,
    backend: str,
    fn: Callable,
    args: tuple,
    kwargs: dict,
    queue,
) -> None:
    """Child process body: one thread, join the world, run `fn`, report `(rank, ok, result | traceback)`."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)  # N ranks share this host's cores; the env var alone is read too late
    try:
        device_kwargs: dict[str, torch.device] = {}
        if backend == "nccl":
            # Before init: NCCL binds its communicators to the current device, and device_id makes
            # the default group eager, so a rank without its GPU fails here rather than in fn.
            torch.cuda.set_device(rank)
            device_kwargs["device_id"] = torch.device("cuda", rank)
        join_world(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
            **device_kwargs,
        )
        queue.put((rank, True, fn(rank, world, *args, **kwargs)))
    except BaseException:  # noqa: BLE001 - the text travels to the parent, which raises it naming this rank
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            leave_world()


def _drain(queue, outcome: dict[int, tuple[bool, Any]]) -> None:
    while not queue.empty():
        rank, ok, payload = queue.get()
        outcome[rank] = (ok, payload)


def _wait(procs: list, queue, deadline: float) -> dict[int, tuple[bool, Any]]:
    """Collect reports until every rank has one, every process has exited, or the deadline passes."""
    outcome: dict[int, tuple[bool, Any]] = {}
    while len(outcome) < len(procs) and time.monotonic() < deadline:
        _drain(queue, outcome)
        if len(outcome) < len(procs) and not any(p.is_alive() for p in procs):
            break
        time.sleep(_POLL_S)
    _drain(queue, outcome)  # a rank may report and exit between the checks above
    return outcome


def _stop(procs: list, reported: set[int]) -> list[int]:
    """Kill the ranks that never reported, give the others a grace to tear down; return the killed ranks."""
    killed = []
    for rank, p in enumerate(procs):
        if rank not in reported and p.is_alive():  # False for a process never started
            p.kill()
            killed.append(rank)
    grace_end = time.monotonic() + _EXIT_GRACE_S
    for rank, p in enumerate(procs):
        if p.pid is None:  # never started: start() of an earlier rank raised
            continue
        p.join(timeout=max(0.0, grace_end - time.monotonic()))
        if p.is_alive():
            log.warning("rank %d reported but did not exit within %.0f s; killing it", rank, _EXIT_GRACE_S)
            p.kill()
            p.join()
    return killed


def run_local_ranks(
    world: int,
    fn: Callable,
    *args: Any,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
    backend: Literal["gloo", "nccl"] = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(rank, world, *args, **kwargs)` on `world` spawned ranks; return the results in rank order.

    `fn` must be a module-level (picklable) function; the default process group (`backend`: gloo on
    CPU, or NCCL with rank r on cuda:r, set as the current device before init) is initialized before
    it runs and destroyed after. `pg_timeout_s` bounds each collective, `timeout_s` the whole run.
    Raises ParallelError for an unknown backend or fewer visible GPUs than ranks under NCCL (before
    any process starts), and carrying every failing rank's traceback and naming the ranks that did
    not finish (killed at the deadline) or exited without reporting.
    """
    if backend not in BACKENDS:
        raise ParallelError(f"run_local_ranks: backend = {backend!r}, expected one of {', '.join(BACKENDS)}")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ParallelError(
            f"run_local_ranks: {world} NCCL ranks need {world} GPUs (one each), torch sees {torch.cuda.device_count()}"
        )
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, pg_timeout_s, backend, fn, args, kwargs, queue), daemon=True)
        for r in range(world)
    ]
    outcome: dict[int, tuple[bool, Any]] = {}
    try:
        for p in procs:
            p.start()
        outcome = _wait(procs, queue, time.monotonic() + timeout_s)
    finally:
        killed = _stop(procs, set(outcome))
    failed = [f"rank {r}:\n{payload}" for r, (ok, payload) in sorted(outcome.items()) if not ok]
    if killed:
        failed.append(f"ranks {killed} did not finish within {timeout_s:.0f} s (killed)")
    silent = [f"rank {r} exited with code {procs[r].exitcode} without reporting" for r in range(world)
              if r not in outcome and r not in killed]
    if failed or silent:
        name = getattr(fn, "__qualname__", repr(fn))
        raise ParallelError(f"{name} on {world} local {backend} ranks failed:\n" + "\n".join(failed + silent))
    return [outcome[r][1] for r in range(world)]
