"""`epdraft bench sync`: the step sync's latency on W local CPU (gloo) ranks, against W = 2.

For each W, spawns W ranks and runs `--iters` back-to-back syncs of each method (after `--warmup`
untimed ones): `host` is `HostExchange` (shared memory on one host: what `StepCoordinator` runs on
CPU ranks of Linux x86-64), `store` is `StoreExchange` (the rendezvous store: what it runs
elsewhere, and between hosts), `gloo_allgather` the one gloo all-gather of the same int64s both
replaced. A rank's time per sync is
its median over the timed syncs; the table shows the slowest rank's, and its ratio to W = 2's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import msgspec
import torch
import torch.distributed as dist

from epdraft.errors import ConfigError
from epdraft.parallel.exchange import HostExchange, StoreExchange, shared_memory_ok
from epdraft.parallel.spawn import run_local_ranks
from epdraft.runtime.coordinator import NO_DIGEST

METHODS = ("host", "store", "gloo_allgather")
# torch >= 2.13 renames all_gather_into_tensor (same semantics); older releases only have the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
NUM_EXTRAS = 2  # what the standalone runner passes per step


class Result(msgspec.Struct, frozen=True, kw_only=True):
    """One method at one world size: what the table prints and --json writes (one JSON line each)."""

    bench: str = "sync"
    torch: str
    cpus: int  # usable cores of this host: W ranks share them
    method: str
    ranks: int
    iters: int
    median_ms: float  # the slowest rank's median
    ratio_to_2: float | None  # median_ms / the same method's at 2 ranks (None when 2 was not run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16], help="world sizes (default 2 4 8 16)")
    parser.add_argument("--methods", default=None, help=f"comma list of: {', '.join(METHODS)} "
                        "(default: every one this host runs; host needs Linux x86-64)")  # fmt: skip
    parser.add_argument("--iters", type=int, default=300, help="timed syncs per method and size (default 300)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed syncs first (default 20)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON lines")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before one size's ranks are killed")


def main(args: argparse.Namespace) -> int:
    runnable = [m for m in METHODS if m != "host" or shared_memory_ok()]
    methods = runnable if args.methods is None else [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in runnable:
            raise ConfigError(f"bench sync --methods: {m!r} must be one of {runnable} on this host")
    if args.iters < 1 or args.warmup < 0 or any(w < 1 for w in args.ranks):
        raise ConfigError("bench sync: --iters and every --ranks must be >= 1, --warmup >= 0")
    medians: dict[tuple[str, int], float] = {}
    for world in args.ranks:
        per_rank = run_local_ranks(world, _rank, methods, args.iters, args.warmup, timeout_s=args.timeout,
                                   pg_timeout_s=args.timeout)  # fmt: skip
        for m in methods:
            medians[m, world] = max(r[m] for r in per_rank)
    results = [
        Result(torch=str(torch.__version__), cpus=len(os.sched_getaffinity(0)), method=m, ranks=w, iters=args.iters,
               median_ms=medians[m, w], ratio_to_2=medians[m, w] / medians[m, 2] if (m, 2) in medians else None)
        for m in methods
        for w in args.ranks
    ]
    _print_table(results)
    if args.json:
        with open(args.json, "wb") as f:
            f.writelines(msgspec.json.encode(r) + b"\n" for r in results)
    return 0


def _print_table(results: list[Result]) -> None:
    print(f"{'method':<16} {'ranks':>5} {'median ms':>10} {'x W=2':>7}")
    for r in results:
        ratio = f"{r.ratio_to_2:.1f}" if r.ratio_to_2 is not None else "-"
        print(f"{r.method:<16} {r.ranks:>5} {r.median_ms:>10.3f} {ratio:>7}")
    print("median over each rank's timed syncs, slowest rank shown; back-to-back syncs, as steps run")


def _rank(rank: int, world: int, methods: list[str], iters: int, warmup: int) -> dict[str, float]:
    """This rank's median ms per sync of each method (every rank checks every sync's counts)."""
    out = {}
    for method in methods:
        if method == "gloo_allgather":
            sync = _gloo_allgather
        else:
            transport = HostExchange if method == "host" else StoreExchange
            # the coordinator's row: [step, rows, engine-counts digest (none here), *extras]
            exchange = transport.over(dist.group.WORLD, width=3 + NUM_EXTRAS)

            def sync(step: int, rows: int, extras: tuple[int, ...], exchange=exchange) -> tuple[int, ...]:
                return tuple(v[1] for v in exchange.all_gather([step, rows, NO_DIGEST, *extras]))
        dist.barrier()
        times = []
        for step in range(warmup + iters):
            start = time.perf_counter()
            counts = sync(step, rank, (step, rank))
            times.append(time.perf_counter() - start)
            if counts != tuple(range(world)):
                raise AssertionError(f"rank {rank}: {method} step {step} gave counts {counts}")
        out[method] = statistics.median(times[warmup:]) * 1e3
    return out


def _gloo_allgather(step: int, rows: int, extras: tuple[int, ...]) -> tuple[int, ...]:
    """The sync before issue 33: one gloo all-gather of `[step, rows, *extras]` (steps unchecked)."""
    mine = torch.tensor([step, rows, *extras], dtype=torch.int64)
    gathered = torch.empty(dist.get_world_size() * mine.numel(), dtype=torch.int64)
    _all_gather_single(gathered, mine)
    return tuple(gathered.view(dist.get_world_size(), -1)[:, 1].tolist())
