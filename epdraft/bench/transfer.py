"""`epdraft bench transfer`: one-way step latency and bandwidth of each transport between 2 local ranks.

Rank 0 sends, rank 1 receives. Each iteration starts from a barrier; latency is the time from
rank 0 entering `send` to rank 1 leaving `recv` (both read CLOCK_MONOTONIC), so it
includes the control messages a transport needs per step. The first iteration (connection set-up,
first touch of the pages) is reported apart and left out of the median. The sender fills the
transport's `send_buffer` once, so no staging copy is timed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import socket
import statistics
import time
import traceback

import msgspec
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from epdraft.errors import ConfigError, ParallelError
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

    timings = _spawn(kinds, cases, args.iters, args.timeout)
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


def _spawn(kinds: list[str], cases: list[Case], iters: int, timeout_s: float) -> list[dict[str, list[float]]]:
    """Run `_rank` on 2 spawned processes; return each rank's timestamps keyed 'kind/label'."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, port, kinds, cases, iters, timeout_s, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < 2 and time.monotonic() < deadline and any(p.is_alive() for p in procs):
        while not queue.empty():
            rank, status, payload = queue.get()
            results[rank] = (status, payload)
        time.sleep(0.05)
    while not queue.empty():
        rank, status, payload = queue.get()
        results[rank] = (status, payload)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    failed = [f"rank {r}: {payload}" for r, (status, payload) in sorted(results.items()) if status != "ok"]
    missing = [r for r in range(2) if r not in results]
    if failed or missing:
        late = f"\nranks {missing} did not finish within {timeout_s:.0f} s (killed)" if missing else ""
        raise ParallelError("bench transfer failed:\n" + "\n".join(failed) + late)
    return [results[0][1], results[1][1]]


def _rank(rank: int, port: int, kinds: list[str], cases: list[Case], iters: int, timeout_s: float, queue) -> None:
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        stamps = {f"{k}/{c.label}": _measure(rank, k, c, iters) for k in kinds for c in cases}
        queue.put((rank, "ok", stamps))
    except BaseException:  # noqa: BLE001 - the text travels to the parent, which raises it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


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
