"""`epdraft bench transfer`: one-way step latency and bandwidth of each transport between 2 local ranks.

Rank 0 sends, rank 1 receives. Each iteration starts from a barrier; latency is the time from
rank 0 entering `send` to rank 1 leaving `recv` (both read CLOCK_MONOTONIC), so it
includes the control messages a transport needs per step. The first iteration (connection set-up,
first touch of the pages) is reported apart and left out of the median. The sender fills the
transport's `send_buffer` once, so no staging copy is timed.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time

import msgspec
import torch.distributed as dist

from epdraft.errors import ConfigError
from epdraft.parallel.spawn import run_local_ranks
from epdraft.worker.transfer import TRANSPORTS, BufferSpec, StepPayload, make_transport, mooncake_unavailable_reason

DEFAULT_SIZES = "0x20480,64x20480,1MiB,64MiB"
BYTE_ROW_DIM = 4096  # a byte-sized payload is bf16 rows of this many features
_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


class Case(msgspec.Struct, frozen=True):
    label: str
    rows: int
    feature_dim: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.feature_dim * 2


class Result(msgspec.Struct, frozen=True, kw_only=True):
    """One transport and payload size: what the table prints and --json writes."""

    transport: str
    payload: str
    rows: int
    feature_dim: int
    bytes: int
    iters: int
    median_us: float
    p90_us: float
    first_us: float
    gb_per_s: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="comma list of: torch, mooncake")
    parser.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help=f"comma list of bf16 payloads: ROWSxDIM, or N[KiB|MiB|GiB] as rows of {BYTE_ROW_DIM} features "
        f"(default {DEFAULT_SIZES})",
    )
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per transport and size (default 20)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are killed")


def parse_size(token: str) -> Case:
    m = re.fullmatch(r"(\d+)x(\d+)", token)
    if m:
        return Case(token, int(m[1]), int(m[2]))
    m = re.fullmatch(r"(\d+)(KiB|MiB|GiB)", token)
    row_bytes = BYTE_ROW_DIM * 2
    if m and (int(m[1]) * _UNITS[m[2]]) % row_bytes == 0:
        return Case(token, int(m[1]) * _UNITS[m[2]] // row_bytes, BYTE_ROW_DIM)
    raise ConfigError(f"bench transfer --sizes: {token!r} must be ROWSxDIM or a multiple of {row_bytes} B like 1MiB")


def main(args: argparse.Namespace) -> int:
    if args.iters < 1:
        raise ConfigError(f"bench transfer --iters = {args.iters} must be >= 1")
    cases = [parse_size(t) for t in args.sizes.split(",") if t]
    kinds = [k for k in args.transports.split(",") if k]
    for kind in kinds:
        if kind not in TRANSPORTS:
            raise ConfigError(f"bench transfer --transports: {kind!r} must be one of {list(TRANSPORTS)}")
    reason = mooncake_unavailable_reason() if "mooncake" in kinds else None
    if reason is not None:
        print(f"mooncake: skipped: {reason}")
        kinds.remove("mooncake")
    if not kinds or not cases:
        raise ConfigError("bench transfer: nothing to measure (no available transport or no size)")

    timings = run_local_ranks(2, _rank, kinds, cases, args.iters, timeout_s=args.timeout, pg_timeout_s=args.timeout)
    results = [
        _summarize(kind, case, timings[0][f"{kind}/{case.label}"], timings[1][f"{kind}/{case.label}"])
        for kind in kinds
        for case in cases
    ]
    _print_table(results)
    if args.json:
        with open(args.json, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(results), indent=1))
    return 0


def _summarize(kind: str, case: Case, sent: list[float], received: list[float]) -> Result:
    """One-way latencies from paired timestamps; the first (set-up) iteration is kept apart."""
    lat_s = [r - s for s, r in zip(sent, received)]
    timed = lat_s[1:]
    median = statistics.median(timed)
    p90 = statistics.quantiles(timed, n=10)[-1] if len(timed) > 1 else median
    return Result(
        transport=kind,
        payload=case.label,
        rows=case.rows,
        feature_dim=case.feature_dim,
        bytes=case.nbytes,
        iters=len(timed),
        median_us=median * 1e6,
        p90_us=p90 * 1e6,
        first_us=lat_s[0] * 1e6,
        gb_per_s=case.nbytes / median / 1e9,
    )


def _print_table(results: list[Result]) -> None:
    print(
        f"{'transport':<10} {'payload':<10} {'rows x dim':>13} {'bytes':>10} "
        f"{'median':>10} {'p90':>10} {'first':>10} {'GB/s':>7}"
    )
    for r in results:
        shape = f"{r.rows} x {r.feature_dim}"
        print(
            f"{r.transport:<10} {r.payload:<10} {shape:>13} {_fmt_bytes(r.bytes):>10} {_fmt_us(r.median_us):>10} "
            f"{_fmt_us(r.p90_us):>10} {_fmt_us(r.first_us):>10} {r.gb_per_s:>7.2f}"
        )
    print("latency: one-way, send entry on rank 0 to recv exit on rank 1; median and p90 exclude the first")


def _fmt_us(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.0f} us"


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _rank(rank: int, world: int, kinds: list[str], cases: list[Case], iters: int) -> dict[str, list[float]]:
    """One rank's timestamps for every transport and size, keyed 'kind/label'."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # before any transport imports mooncake
    return {f"{k}/{c.label}": _measure(rank, k, c, iters) for k in kinds for c in cases}


def _measure(rank: int, kind: str, case: Case, iters: int) -> list[float]:
    """Rank 0: timestamps of entering send; rank 1: of leaving recv; one warm-up plus `iters`."""
    requests = min(case.rows, 8)
    spec = BufferSpec(max_rows=case.rows, feature_dim=case.feature_dim, max_requests=requests, dtype="bfloat16")
    transport = make_transport(kind, dist.group.WORLD, hostname="127.0.0.1")
    stamps = []
    try:
        transport.register({1 - rank: spec})
        features_RD = transport.send_buffer(1 - rank).fill_(1.0)
        payload = StepPayload(step=0, features_RD=features_RD, accept_lens=[3] * requests, bonus_tokens=[7] * requests)
        for _ in range(iters + 1):
            dist.barrier()
            if rank == 0:
                stamps.append(time.monotonic())
                transport.send(1, payload)
            else:
                transport.recv(0)
                stamps.append(time.monotonic())
    finally:
        transport.close()
    return stamps
