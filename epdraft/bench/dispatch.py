"""`epdraft bench dispatch --config C --rows N[,N...]`: median step time of each MoE layout, per phase.

`--device cpu` (default): the config's ranks as CPU processes over gloo, fp32, whatever the
config's device: this measures the layouts' protocol cost, not a GPU. `--device cuda`: an NCCL
world of the config's size on this host's GPUs (rank r on cuda:r), bf16; `--a2a-backends` adds
`torch_fixed` (one equal-split collective per direction), DeepEP (`deepep`, `deepep_ll` =
low-latency kernels) and Mooncake EP to the alltoall layout, and
each layout reports the bytes its dispatch sends per rank against NVLink's 450 GB/s per direction.

For every layout the config's moe_ep x moe_tp allows, and every combination of `--rows`,
`--hidden` and `--top-k` (comma lists, one world for the whole sweep), it runs `--warmup` + `--steps`
steps of one synthetic MoE layer with N random rows per rank, timing sync (StepCoordinator on the gloo
`cpu` group), dispatch, experts and combine. On CPU sync includes the router and every phase is
wall clock; on CUDA sync is wall clock, the router runs untimed after it, and dispatch, experts and
combine are CUDA events (read after a device synchronize at the end of each step). A phase's time
per step is the slowest rank's; the table shows medians. Prints a table per combination on stdout;
`--json FILE` appends one JSON line per layout and combination to FILE (config, device, versions,
every phase's median), stdout keeping the tables only.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from epdraft.config.ffn import DraftMoeFFNSpec, RouterSpec
from epdraft.config.parallel import ParallelConfig, load_parallel_config
from epdraft.dispatch.planner import layout_candidates
from epdraft.errors import ConfigError
from epdraft.parallel.spawn import run_local_ranks

PHASES = ("sync", "dispatch", "experts", "combine")
CPU_OVERRIDES = ('cluster.device="cpu"', 'cluster.backend="gloo"', 'draft.a2a_backend="torch"')
CUDA_OVERRIDES = ('cluster.device="cuda"', 'cluster.backend="nccl"', 'draft.a2a_backend="torch"')
A2A_BACKENDS = ("torch", "torch_fixed", "deepep", "deepep_ll", "mooncake")
CPU_A2A_BACKENDS = ("torch", "torch_fixed")
NVLINK_GB_S = 450.0  # H100/H200 NVLink 4, per direction
_PER_PAIR = ("deepep_ll", "mooncake")  # fixed-buffer kernels send one copy per (token, expert), not per (token, rank)


@dataclasses.dataclass(frozen=True)
class Sweep:
    """What one world measures (picklable: it travels to the spawned ranks)."""

    device: str
    rows: tuple[int, ...]
    hidden: tuple[int, ...]
    top_k: tuple[int, ...]
    experts: int
    intermediate: int
    steps: int
    warmup: int
    a2a_backends: tuple[str, ...]


def _int_list(flag: str):
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected integers separated by commas") from None
        if not values or len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected one or more distinct integers")
        return values

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True,
                        help="parallel config (.toml/.yaml/.json, or a shipped name); its ranks run here")  # fmt: skip
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. cluster.nproc_per_node=4")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo ranks, fp32 (default); cuda: NCCL ranks on local GPUs, bf16")
    parser.add_argument("--rows", type=_int_list("--rows"), required=True, help="rows per rank per step, e.g. 1,16,128,512")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per layout (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per layout first (default 3)")
    parser.add_argument("--hidden", type=_int_list("--hidden"), default=(1024,), help="hidden size H, list (default 1024)")
    parser.add_argument("--experts", type=int, default=8, help="routed experts E (default 8)")
    parser.add_argument("--top-k", type=_int_list("--top-k"), default=(2,), help="top-k, list (default 2)")
    parser.add_argument("--intermediate", type=int, default=512, help="per-expert intermediate size I (default 512)")
    parser.add_argument("--a2a-backends", default=None,
                        help=f"alltoall backends, comma list of {', '.join(A2A_BACKENDS)} "
                        "(default: torch on cpu, the config's draft.a2a_backend on cuda)")
    parser.add_argument("--json", type=Path, default=None,
                        help="append one JSON line per layout and combination to this file (stdout: tables only)")


def variants(pc: ParallelConfig, a2a_backends: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(layout, dp_padding, backend) triples: the planner's candidates, the alltoall layout once per backend."""
    return [
        (layout, padding, backend)
        for layout, padding in layout_candidates(pc.draft.moe_ep, pc.draft.moe_tp)
        for backend in (a2a_backends if layout == "alltoall" else ("torch",))
    ]


def _label(layout: str, padding: str, backend: str) -> str:
    if layout == "gather":
        return f"gather ({padding})"
    return layout if backend == "torch" else f"{layout} ({backend})"


def _sent_rows(layout: str, backend: str, ids_TK: torch.Tensor, group_rank: int, group_size: int, e: int) -> int:
    """Rows of H values this rank's dispatch sends to other ranks (combine sends as many back).

    gather: its rows (every rank has as many, so no max_len padding) to each other member; alltoall:
    one row per (token, other owner rank), or per (token, expert on another rank) for the
    fixed-buffer backends, or a full slab per peer for torch_fixed. moe_tp = 1 under alltoall, so group rank = EP rank.
    """
    T = ids_TK.shape[0]
    if layout == "replicated":
        return 0
    if layout == "gather" or backend == "torch_fixed":  # torch_fixed: a slab of C = T rows to each peer
        return T * (group_size - 1)
    elsewhere_TK = ids_TK // e != group_rank
    if backend in _PER_PAIR:
        return int(elsewhere_TK.sum())
    dest_TG = torch.zeros(T, group_size, dtype=torch.bool, device=ids_TK.device)
    dest_TG.scatter_(1, ids_TK // e, True)
    dest_TG[:, group_rank] = False
    return int(dest_TG.sum())


class _Marks:
    """Boundaries of the dispatch/experts/combine phases: perf_counter on CPU, CUDA events on GPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def spans_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in itertools.pairwise(self.marks)]
        return [(b - a) * 1e3 for a, b in itertools.pairwise(self.marks)]


def _time_layouts(rank: int, world: int, pc: ParallelConfig, sweep: Sweep) -> list[dict]:
    """One rank's loop: every layout x (hidden, top_k) x rows, warmup + steps; rank 0 returns the medians."""
    from epdraft.dispatch import MoeLayout, make_dispatcher
    from epdraft.layers.moe import DraftMoE
    from epdraft.parallel.groups import Groups
    from epdraft.runtime.coordinator import StepCoordinator

    cuda = sweep.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    groups = Groups.from_config(pc)
    sync = StepCoordinator(groups.cpu)
    results, step = [], 0
    for hidden, top_k in itertools.product(sweep.hidden, sweep.top_k):
        spec = DraftMoeFFNSpec(
            router=RouterSpec(num_experts=sweep.experts, top_k=top_k), intermediate_size=sweep.intermediate
        )
        for layout, padding, backend in variants(pc, sweep.a2a_backends):
            sharded = layout != "replicated"
            head = {"layout": layout, "dp_padding": padding, "hidden": hidden, "top_k": top_k}
            if cuda:
                head["a2a_backend"] = backend
            facts = dict(num_experts=spec.num_experts, hidden_size=hidden, top_k=spec.top_k, device_type=sweep.device)
            moe_layout = MoeLayout.local(**facts)
            if sharded:
                moe_layout = MoeLayout(
                    layout=layout, backend=backend.removesuffix("_ll"), dp_padding=padding,
                    low_latency=backend == "deepep_ll", max_rows_per_rank=-(-max(sweep.rows) // 4) * 4,
                    ep_rank=groups.ep_rank, ep_size=groups.ep_size, tp_rank=groups.tp_rank, tp_size=groups.tp_size,
                    **facts,
                )  # fmt: skip
            try:
                dispatcher = make_dispatcher(moe_layout, groups.moe if sharded else None)
            except ConfigError as e:  # raised alike on every rank before any collective: all skip together
                results += [{**head, "rows_per_rank": rows, "skipped": str(e)} for rows in sweep.rows]
                continue
            moe = DraftMoE(spec, hidden, dispatcher=dispatcher, dtype=dtype, device=device)
            with torch.no_grad():
                for p in moe.parameters():
                    gen = torch.Generator(device=device).manual_seed(7)
                    p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.02)
            gen = torch.Generator(device=device).manual_seed(rank)
            for rows in sweep.rows:
                times = {p: [] for p in PHASES}
                sent = []
                with torch.no_grad():
                    for i in range(sweep.warmup + sweep.steps):
                        x = torch.randn(rows, hidden, generator=gen, device=device).to(dtype)
                        t0 = time.perf_counter()
                        plan = sync.sync(step, x.shape[0])
                        if not cuda:
                            ids, weights = moe.router(x)
                        sync_ms = (time.perf_counter() - t0) * 1e3
                        if cuda:
                            ids, weights = moe.router(x)
                        marks = _Marks(cuda)
                        marks.mark()
                        handle = dispatcher.dispatch(x, ids, weights, plan)
                        marks.mark()
                        y = moe.experts(handle.rows_RH, handle.ids_RK, handle.weights_RK)
                        marks.mark()
                        dispatcher.combine(y, handle)
                        marks.mark()
                        step += 1
                        spans = [sync_ms, *marks.spans_ms()]
                        if i >= sweep.warmup:
                            for phase, dt in zip(PHASES, spans):
                                times[phase].append(dt)
                            if cuda:
                                g = dist.get_rank(groups.moe) if sharded else 0
                                n = groups.moe.size() if sharded else 1
                                sent.append(_sent_rows(layout, backend, ids, g, n, spec.num_experts // n))
                everyone = [None] * dist.get_world_size(groups.cpu)
                dist.all_gather_object(everyone, (times, sent), group=groups.cpu)
                slowest = {p: [max(r[0][p][s] for r in everyone) for s in range(sweep.steps)] for p in PHASES}
                medians = {p: statistics.median(v) for p, v in slowest.items()}
                medians["step"] = statistics.median([sum(slowest[p][s] for p in PHASES) for s in range(sweep.steps)])
                result = {**head, "rows_per_rank": rows, "median_ms": medians}
                if cuda:
                    sent_max = [max(r[1][s] for r in everyone) for s in range(sweep.steps)]
                    result["dispatch_bytes_per_rank"] = int(statistics.median(sent_max)) * hidden * dtype.itemsize
                results.append(result)
            dispatcher.close()
            del moe
    return results if rank == 0 else []


def _nvlink_columns(r: dict) -> str:
    """Bytes per rank, the time NVLink needs for them and the achieved share of its bandwidth."""
    nbytes = r["dispatch_bytes_per_rank"]
    floor_us = nbytes / (NVLINK_GB_S * 1e3)
    disp_gbs = nbytes / (r["median_ms"]["dispatch"] * 1e6) if nbytes else 0.0
    comb_gbs = nbytes / (r["median_ms"]["combine"] * 1e6) if nbytes else 0.0
    return f"{nbytes / 1024:>11.1f}{floor_us:>10.2f}{disp_gbs:>9.2f}{comb_gbs:>9.2f}{100 * disp_gbs / NVLINK_GB_S:>8.2f}"


def _print_tables(results: list[dict], pc: ParallelConfig, sweep: Sweep, gpu_name: str) -> None:
    cuda = sweep.device == "cuda"
    d = pc.draft
    scale, unit = (1e3, "us") if cuda else (1.0, "ms")
    width = max(18, *(len(_label(r["layout"], r["dp_padding"], r.get("a2a_backend", "torch"))) + 2 for r in results))
    for (hidden, top_k, rows), group in itertools.groupby(results, key=lambda r: (r["hidden"], r["top_k"], r["rows_per_rank"])):
        where = f"{pc.world_size} GPUs ({gpu_name}), NCCL, bf16" if cuda else f"{pc.world_size} CPU ranks"
        print(f"{where}, moe_ep = {d.moe_ep}, moe_tp = {d.moe_tp}, {rows} rows/rank, H = {hidden}, "
              f"E = {sweep.experts}, top-{top_k}, I = {sweep.intermediate}; median of {sweep.steps} steps, {unit}")  # fmt: skip
        extra = f"{'KiB/rank':>11}{'NVL us':>10}{'d GB/s':>9}{'c GB/s':>9}{'d %NVL':>8}" if cuda else ""
        print(f"{'layout':<{width}}" + "".join(f"{p:>10}" for p in (*PHASES, "step")) + extra)
        for r in group:
            label = _label(r["layout"], r["dp_padding"], r.get("a2a_backend", "torch"))
            if "skipped" in r:
                print(f"{label:<{width}}skipped: {r['skipped']}")
                continue
            line = "".join(f"{r['median_ms'][p] * scale:>10.3f}" for p in (*PHASES, "step"))
            print(f"{label:<{width}}{line}" + (_nvlink_columns(r) if cuda else ""))
    if cuda:
        print(f"KiB/rank: what one rank's dispatch sends to other ranks (bf16 rows, median over steps of the max over "
              f"ranks; combine sends as much back); NVL us: that at NVLink's {NVLINK_GB_S:.0f} GB/s per direction; "
              "d/c GB/s: achieved by dispatch/combine; d %NVL: dispatch's share of NVLink")  # fmt: skip


def _check_shapes(args: argparse.Namespace, pc: ParallelConfig) -> None:
    """The synthetic layer's sizes, checked here: inside the spawned ranks a bad one is a traceback per rank."""
    sizes = {"--hidden": args.hidden, "--experts": (args.experts,), "--intermediate": (args.intermediate,)}
    for flag, values in sizes.items():
        if min(values) < 1:
            raise ConfigError(f"{flag} {','.join(map(str, values))}: expected integers >= 1")
    bad_k = [k for k in args.top_k if not 1 <= k <= args.experts]
    if bad_k:
        raise ConfigError(f"--top-k {bad_k[0]}: expected 1 <= top-k <= --experts {args.experts}")
    d = pc.draft
    if args.experts % d.moe_ep:
        raise ConfigError(f"--experts {args.experts}: draft.moe_ep = {d.moe_ep} must divide it")
    if args.intermediate % d.moe_tp:
        raise ConfigError(f"--intermediate {args.intermediate}: draft.moe_tp = {d.moe_tp} must divide it")


def main(args: argparse.Namespace) -> int:
    if min(args.rows) < 0 or args.steps < 1 or args.warmup < 0:
        rows = ",".join(map(str, args.rows))
        raise ConfigError(f"--rows {rows} must be >= 0, --steps {args.steps} >= 1, --warmup {args.warmup} >= 0")
    cuda = args.device == "cuda"
    asked = load_parallel_config(args.config, args.set)
    pc = load_parallel_config(args.config, [*args.set, *(CUDA_OVERRIDES if cuda else CPU_OVERRIDES)])
    _check_shapes(args, pc)
    default_a2a = asked.draft.a2a_backend if cuda else "torch"
    a2a = [b for b in args.a2a_backends.split(",") if b] if args.a2a_backends else [default_a2a]
    for backend in a2a:
        if backend not in A2A_BACKENDS or (backend not in CPU_A2A_BACKENDS and not cuda):
            allowed = A2A_BACKENDS if cuda else CPU_A2A_BACKENDS
            raise ConfigError(f"--a2a-backends {backend!r}: --device {args.device} takes {', '.join(allowed)}")
    sweep = Sweep(
        device=args.device, rows=args.rows, hidden=args.hidden, top_k=args.top_k, experts=args.experts,
        intermediate=args.intermediate, steps=args.steps, warmup=args.warmup, a2a_backends=tuple(a2a),
    )  # fmt: skip
    # Ranks are killed at twice the collective timeout: a hang shows up as a ParallelError naming them.
    results = run_local_ranks(
        pc.world_size, _time_layouts, pc, sweep, timeout_s=2 * pc.cluster.timeout_s,
        pg_timeout_s=pc.cluster.timeout_s, backend="nccl" if cuda else "gloo",
    )[0]  # fmt: skip
    d = pc.draft
    gpu_name = torch.cuda.get_device_name(0) if cuda else ""
    header = {
        "bench": "dispatch",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": str(args.config),
        "world": pc.world_size,
        "moe_ep": d.moe_ep,
        "moe_tp": d.moe_tp,
        "rows_per_rank": None,
        "steps": args.steps,
        "hidden": None,
        "experts": args.experts,
        "top_k": None,
        "intermediate": args.intermediate,
        "device": f"{pc.world_size} x {gpu_name}, nccl, bfloat16" if cuda
        else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), gloo",
        "torch": torch.__version__,
    }  # fmt: skip
    if cuda:
        header["overrides"] = list(args.set)
    # Tables group by (hidden, top_k, rows) in the order asked; within one, layouts in run order (stable sort).
    results.sort(key=lambda r: (args.hidden.index(r["hidden"]), args.top_k.index(r["top_k"]),
                                args.rows.index(r["rows_per_rank"])))  # fmt: skip
    _print_tables(results, pc, sweep, gpu_name)
    if args.json is not None:
        with args.json.open("a") as f:
            f.write("".join(json.dumps({**header, **r}) + "\n" for r in results))
    return 0
