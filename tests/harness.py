"""Run a function on N CPU ranks (gloo) with a deadline: the one multi-rank test harness.

A thin test-side face of `epdraft.parallel.spawn.run_local_ranks`: a failing or hung rank fails the
test with an AssertionError carrying the rank's traceback or naming the ranks killed at the deadline.
"""

from __future__ import annotations

from typing import Any, Callable

from epdraft.errors import ParallelError
from epdraft.parallel.spawn import free_port, run_local_ranks

__all__ = ["free_port", "run_ranks"]


def run_ranks(
    world: int, fn: Callable, *args: Any, timeout_s: float = 120.0, pg_timeout_s: float = 60.0, **kwargs: Any
) -> list[Any]:
    """Run `fn(rank, world, *args, **kwargs)` on `world` gloo ranks; return each rank's result.

    Raises AssertionError with every failing rank's traceback, or naming the ranks that did not
    finish within `timeout_s` (those are killed).
    """
    try:
        return run_local_ranks(world, fn, *args, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s, **kwargs)
    except ParallelError as e:
        raise AssertionError(str(e)) from None
