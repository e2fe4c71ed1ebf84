"""Run a function on N CPU ranks (gloo) with a deadline: the one multi-rank test harness.

Each rank is a spawned process with its own free-port rendezvous; exceptions travel back as text and
fail the test naming the rank; a rank still running at the deadline is killed, so a hang is a
failure, never a stuck CI job.
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, kwargs: dict, queue, pg_timeout_s: float):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world, *args, **kwargs)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - the text travels to the parent, which fails the test
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    world: int, fn: Callable, *args: Any, timeout_s: float = 120.0, pg_timeout_s: float = 60.0, **kwargs: Any
) -> list[Any]:
    """Run `fn(rank, world, *args, **kwargs)` on `world` gloo ranks; return each rank's result.

    Raises AssertionError with every failing rank's traceback, or naming the ranks that did not
    finish within `timeout_s` (those are killed).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, fn, args, kwargs, queue, pg_timeout_s), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    import time

    while len(results) < world and datetime.datetime.now() < deadline:
        while not queue.empty():
            rank, status, payload = queue.get()
            results[rank] = (status, payload)
        if len(results) < world:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
            time.sleep(0.05)
    while not queue.empty():
        rank, status, payload = queue.get()
        results[rank] = (status, payload)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    errors = [f"rank {r}:\n{payload}" for r, (status, payload) in sorted(results.items()) if status == "error"]
    missing = [r for r in range(world) if r not in results]
    if errors or missing:
        msg = "\n".join(errors)
        if missing:
            msg += f"\nranks {missing} did not finish within {timeout_s:.0f} s (killed)"
        raise AssertionError(msg)
    return [results[r][1] for r in range(world)]
