"""`epdraft plan CONFIG DRAFT`: estimate each MoE layout's per-step cost and choose one (for `auto`).

The model is deliberately small: a draft step's MoE time is the experts' weight reads (small
batches are weight-bandwidth bound) plus, per collective, one link latency and the bytes over the
link bandwidth. Layouts whose expert weights do not fit the per-rank memory budget are ruled out.
Defaults per link are published figures (see the performance reference); every number can be
overridden, and the printout shows the estimates behind the choice.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

from epdraft.config.ffn import DraftMoeFFNSpec
from epdraft.config.hf import DraftMixFFNSpec
from epdraft.config.parallel import ParallelConfig
from epdraft.errors import ConfigError

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Link:
    """A link class: bandwidth per direction (GB/s = 1e9 B/s) and per-collective latency (us)."""

    name: str
    bandwidth_gbps: float
    latency_us: float


LINKS = {
    "nvlink": Link("nvlink", 370.0, 25.0),  # NCCL busBw on NVLink 4; torch all_to_all EP8 ~24 us
    "ib": Link("ib", 45.0, 40.0),  # CX7 400 Gb/s RDMA as DeepEP measures it
    "tcp": Link("tcp", 2.4, 50.0),  # loopback TCP on a small host (4 KiB ~50 us, 64 MiB ~2.4 GB/s)
}
MEMORY_BANDWIDTH_GBPS = {"cuda": 4800.0, "cpu": 20.0}  # H200 HBM3e; a modest host


@dataclasses.dataclass(frozen=True)
class LayoutEstimate:
    """One candidate's per-step estimate over all MoE layers."""

    layout: str
    dp_padding: str
    comm_us: float
    experts_us: float
    expert_bytes_per_rank: int
    fits: bool

    @property
    def total_us(self) -> float:
        return self.comm_us + self.experts_us

    @property
    def label(self) -> str:
        return f"{self.layout} ({self.dp_padding})" if self.layout == "gather" else self.layout


@dataclasses.dataclass(frozen=True)
class PlanChoice:
    """The chosen layout, every estimate (cheapest first) and a one-line reason."""

    layout: str
    dp_padding: str
    estimates: tuple[LayoutEstimate, ...]
    reason: str


def _distinct(held: float, num_experts: int, pairs: float) -> float:
    """Expected experts touched among `held` when `pairs` token-expert pairs fall uniformly on E experts."""
    return held * (1.0 - (1.0 - 1.0 / num_experts) ** pairs)


def _estimate(
    layout: str, padding: str, moe: DraftMoeFFNSpec, hidden: int, ep: int, tp: int, rows: int, link: Link,
    mem_bw_gbps: float, dtype_bytes: int, weight_bytes: float,
) -> tuple[float, float, int]:
    """(comm_us, experts_us, expert_bytes_per_rank) of one MoE layer: its experts at `weight_bytes` a weight
    (`expert_weight_bytes`), the rows it moves at `dtype_bytes` a value."""
    E, K, I = moe.num_experts, moe.top_k, moe.intermediate_size
    G = ep * tp if layout != "replicated" else 1
    held, F_ = (E, I) if layout == "replicated" else (E // ep, I // tp)
    expert_bytes = int(held * 3 * F_ * hidden * weight_bytes)
    touched = _distinct(held, E, G * rows * K)
    experts_us = touched * 3 * F_ * hidden * weight_bytes / (mem_bw_gbps * 1e3)
    row_bytes = hidden * dtype_bytes
    route_bytes = 2 * K * 4  # ids and weights as fp32 beside each row
    us_per_byte = 1.0 / (link.bandwidth_gbps * 1e3)
    if layout == "replicated":
        comm_us = 0.0
    elif layout == "alltoall":
        destinations = _distinct(ep, ep, K)  # ranks a token visits
        sent = rows * destinations * (ep - 1) / ep
        comm_us = 4 * link.latency_us + sent * (2 * row_bytes + route_bytes) * us_per_byte  # counts, rows, routes, back
    elif padding == "max_len":
        gathered = (G - 1) * rows
        comm_us = 3 * link.latency_us + gathered * (2 * row_bytes + route_bytes) * us_per_byte
    else:
        reduced = 2 * (G - 1) * rows  # ring all-reduce moves 2(G-1)/G of the G*rows buffer
        comm_us = 3 * link.latency_us + reduced * (2 * row_bytes + route_bytes) * us_per_byte
    return comm_us, experts_us, expert_bytes


def expert_weight_bytes(spec: DraftMixFFNSpec, *, tp: int, device: str, dtype_bytes: int) -> tuple[float, str]:
    """(bytes a quantized routed-expert weight takes as a rank holds it, the reason in words). The experts a
    checkpoint stores quantized stay so where the fused kernels run them (CUDA, whole experts: moe_tp 1, gate
    rows first, shapes the kernels take): then the stored format counts, scales included
    (`QuantSpec.bits_per_weight`: FP4 / MXFP4 4.25 bits, FP8 8 and its block scales); elsewhere they are
    dequantized at load to `dtype_bytes`. Unquantized layers always count `dtype_bytes`. The rule is the
    runtime's (`layers.step_kernels.quantized_experts_reason`, which this tier may not import; a test holds
    them equal), less its Triton check."""
    import torch

    from epdraft.kernels.experts import fused

    quantized = [m for m in spec.layers if isinstance(m, DraftMoeFFNSpec) and m.quantization is not None]
    if not quantized:
        return float(dtype_bytes), f"experts unquantized, {dtype_bytes} B a weight"
    why = None
    if tp > 1:
        why = f"draft.moe_tp = {tp} slices the experts; quantized experts are held whole"
    for m in quantized:
        if why is None and m.activation.kind == "swigluoai":
            why = "gpt-oss interleaves gate and up rows; quantized experts are held gate rows first"
        q = m.quantization.experts
        why = why or fused.quantized_unsupported_reason(q.method, q.block, spec.hidden_size, m.intermediate_size,
                                                        device, torch.bfloat16)  # fmt: skip
    if why is not None:
        return float(dtype_bytes), f"quantized experts dequantized at load to {dtype_bytes} B a weight ({why})"
    q = quantized[0].quantization.experts
    return q.bits_per_weight / 8, f"quantized experts held as stored: {q.bits_per_weight:g} bits a weight ({q.method})"


def layout_candidates(ep: int, tp: int) -> list[tuple[str, str]]:
    """The (layout, dp_padding) pairs a moe_ep x moe_tp split can run, replicated first.

    The one list: the planner costs these and `epdraft bench dispatch` times these, so a layout
    added here is both estimated and measured. alltoall only at moe_tp = 1: its backends send
    tokens to whole experts (the config refuses alltoall with moe_tp > 1 for the same reason).
    """
    candidates = [("replicated", "max_len")]
    if ep * tp > 1:
        if tp == 1:
            candidates.append(("alltoall", "max_len"))
        candidates += [("gather", "max_len"), ("gather", "sum_len")]
    return candidates


def choose_layout(
    spec: DraftMixFFNSpec,
    *,
    ep: int,
    tp: int,
    rows_per_rank: int,
    link: Link,
    mem_bw_gbps: float,
    memory_budget_bytes: int,
    dtype_bytes: int = 2,
    device: str = "cuda",
) -> PlanChoice:
    """Cheapest layout for this draft at the config's moe_ep x moe_tp among those that fit in memory.

    Quantized experts count at the bytes `device`'s ranks hold them in under each layout
    (`expert_weight_bytes`: a gather layout's moe_tp slices are dequantized). Pure: the caller (the
    worker resolving `auto`) logs `reason` once.

    Raises ConfigError when no candidate's expert shard fits `memory_budget_bytes`.
    """
    moe_layers = [layer for layer in spec.layers if isinstance(layer, DraftMoeFFNSpec)]
    estimates = []
    for layout, padding in layout_candidates(ep, tp):
        sliced = tp if layout == "gather" else 1  # replicated and alltoall hold whole experts
        quantized_bytes = expert_weight_bytes(spec, tp=sliced, device=device, dtype_bytes=dtype_bytes)[0]
        per_layer = [
            _estimate(layout, padding, m, spec.hidden_size, ep, tp, rows_per_rank, link, mem_bw_gbps, dtype_bytes,
                      quantized_bytes if m.quantization is not None else dtype_bytes)
            for m in moe_layers
        ]  # fmt: skip
        expert_bytes = sum(p[2] for p in per_layer)
        estimates.append(
            LayoutEstimate(
                layout=layout,
                dp_padding=padding,
                comm_us=sum(p[0] for p in per_layer),
                experts_us=sum(p[1] for p in per_layer),
                expert_bytes_per_rank=expert_bytes,
                fits=expert_bytes <= memory_budget_bytes,
            )
        )
    estimates.sort(key=lambda est: (not est.fits, est.total_us))
    best = estimates[0]
    if not best.fits:
        smallest = min(e.expert_bytes_per_rank for e in estimates)
        raise ConfigError(
            f"draft.moe_ep = {ep}, draft.moe_tp = {tp}: the smallest expert shard needs "
            f"{smallest / GIB:.1f} GiB per rank, over the {memory_budget_bytes / GIB:.1f} GiB budget"
        )
    runner_up = next((e for e in estimates[1:] if e.fits), None)
    reason = f"{best.label}: {best.total_us:.0f} us/step estimated over {len(moe_layers)} MoE layers"
    if runner_up is not None:
        reason += f", vs {runner_up.label} {runner_up.total_us:.0f} us"
    ruled_out = [e.label for e in estimates if not e.fits]
    if ruled_out:
        reason += f"; {', '.join(ruled_out)} over the {memory_budget_bytes / GIB:.1f} GiB expert budget"
    return PlanChoice(layout=best.layout, dp_padding=best.dp_padding, estimates=tuple(estimates), reason=reason)


def config_link(pc: ParallelConfig, name: str | None = None) -> Link:
    """The link class `name`, or the config's: TCP for CPU ranks, InfiniBand when the MoE group spans nodes."""
    if name is not None:
        return LINKS[name]
    if pc.cluster.device == "cpu":
        return LINKS["tcp"]
    return LINKS["ib" if pc.draft.moe_group_size > pc.cluster.nproc_per_node else "nvlink"]


def choose_for_config(
    pc: ParallelConfig,
    spec: DraftMixFFNSpec,
    *,
    rows_per_rank: int = 64,
    link: Link | None = None,
    mem_bw_gbps: float | None = None,
    memory_budget_bytes: int = 16 * GIB,
    dtype_bytes: int = 2,
) -> PlanChoice:
    """`choose_layout` at the config's moe_ep x moe_tp, with the config's link and device defaults."""
    device = "cpu" if pc.cluster.device == "cpu" else "cuda"
    return choose_layout(
        spec,
        ep=pc.draft.moe_ep,
        tp=pc.draft.moe_tp,
        rows_per_rank=rows_per_rank,
        link=link or config_link(pc),
        mem_bw_gbps=mem_bw_gbps or MEMORY_BANDWIDTH_GBPS[device],
        memory_budget_bytes=memory_budget_bytes,
        dtype_bytes=dtype_bytes,
        device=device,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG",
                        help="parallel config (.toml/.yaml/.json, or a shipped name such as local-cpu-2)")  # fmt: skip
    parser.add_argument("draft", metavar="DRAFT", help="draft checkpoint directory or its config.json")
    parser.add_argument("--rows", type=int, default=64, help="draft rows per rank per step (default 64)")
    parser.add_argument("--link", choices=sorted(LINKS), help="link class (default: from the config's cluster)")
    parser.add_argument("--bandwidth-gbps", type=float, help="override the link bandwidth, GB/s per direction")
    parser.add_argument("--latency-us", type=float, help="override the per-collective latency, us")
    parser.add_argument("--mem-bw-gbps", type=float, help="override the device memory bandwidth, GB/s")
    parser.add_argument("--memory-gib", type=float, default=16.0, help="per-rank budget for expert weights (default 16)")
    parser.add_argument("--dtype-bytes", type=int, default=2,
                        help="bytes per unquantized expert weight and per moved value (default 2, bf16); quantized "
                        "experts count their stored format where the kernels keep it")


def _check_flags(args: argparse.Namespace) -> None:
    """Negative rows or bandwidths would print a plan of negative costs; refuse them instead."""
    positive = {"--bandwidth-gbps": args.bandwidth_gbps, "--mem-bw-gbps": args.mem_bw_gbps, "--memory-gib": args.memory_gib}
    for flag, value in positive.items():
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{flag} {value:g}: expected a finite number > 0")
    if args.latency_us is not None and not (math.isfinite(args.latency_us) and args.latency_us >= 0):
        raise ConfigError(f"--latency-us {args.latency_us:g}: expected a finite number >= 0")
    if args.rows < 0:
        raise ConfigError(f"--rows {args.rows}: expected an integer >= 0")
    if args.dtype_bytes < 1:
        raise ConfigError(f"--dtype-bytes {args.dtype_bytes}: expected an integer >= 1")


def main(args: argparse.Namespace) -> int:
    from epdraft.config.hf import read_config_json
    from epdraft.config.parallel import check_moe_split, load_parallel_config

    _check_flags(args)
    pc = load_parallel_config(args.config)
    draft_config = Path(args.draft) / "config.json" if Path(args.draft).is_dir() else Path(args.draft)
    config = read_config_json(args.draft)
    try:
        spec = DraftMixFFNSpec.from_config(config)
    except ConfigError as e:
        raise ConfigError(f"{draft_config}: {e}") from None
    check_moe_split(pc, spec, source=str(draft_config))  # what `epdraft run` refuses, with its message
    if not spec.moe_layers:
        print(f"{args.draft}: no MoE layer; every layout is 'replicated' (no expert communication)")
        return 0
    link = config_link(pc, args.link)
    link = Link(link.name, args.bandwidth_gbps or link.bandwidth_gbps, args.latency_us or link.latency_us)
    choice = choose_for_config(
        pc,
        spec,
        rows_per_rank=args.rows,
        link=link,
        mem_bw_gbps=args.mem_bw_gbps,
        memory_budget_bytes=int(args.memory_gib * GIB),
        dtype_bytes=args.dtype_bytes,
    )
    d = pc.draft
    print(f"config {args.config}: draft.moe_ep = {d.moe_ep}, draft.moe_tp = {d.moe_tp}, draft.moe_layout = {d.moe_layout!r}")
    print(f"draft {args.draft}: {len(spec.moe_layers)} MoE layers, H = {spec.hidden_size}, {args.rows} rows/rank")
    print(f"link {link.name}: {link.bandwidth_gbps:g} GB/s, {link.latency_us:g} us per collective")
    device = "cpu" if pc.cluster.device == "cpu" else "cuda"
    print(f"experts: {expert_weight_bytes(spec, tp=1, device=device, dtype_bytes=args.dtype_bytes)[1]}"
          + (f"; gather's moe_tp = {d.moe_tp} slices: "
             f"{expert_weight_bytes(spec, tp=d.moe_tp, device=device, dtype_bytes=args.dtype_bytes)[1]}"
             if d.moe_tp > 1 else ""))  # fmt: skip
    print(f"{'layout':<18}{'comm us':>10}{'experts us':>12}{'total us':>10}{'experts GiB/rank':>18}  fits")
    for e in choice.estimates:
        print(
            f"{e.label:<18}{e.comm_us:>10.1f}{e.experts_us:>12.1f}{e.total_us:>10.1f}"
            f"{e.expert_bytes_per_rank / GIB:>18.2f}  {'yes' if e.fits else 'no'}"
        )
    print(f"choice: {choice.layout}" + (f", dp_padding = {choice.dp_padding}" if choice.layout == "gather" else ""))
    print(f"why: {choice.reason}")
    if d.moe_layout not in ("auto", choice.layout):
        print(disagreement(d.moe_layout, d.dp_padding, choice))
    return 0


def disagreement(asked: str, dp_padding: str, choice: PlanChoice) -> str:
    """Why the estimates favour another layout than the config's `asked`: the two side by side."""

    def matches(e: LayoutEstimate, layout: str, padding: str) -> bool:
        return e.layout == layout and (layout != "gather" or e.dp_padding == padding)

    mine = next((e for e in choice.estimates if matches(e, asked, dp_padding)), None)
    best = next(e for e in choice.estimates if matches(e, choice.layout, choice.dp_padding))
    head = f"note: the config asks for {asked!r}; the estimates favour {choice.layout!r}"
    if mine is None:
        return f"{head} ({asked!r} was not estimated for this config)"
    if not mine.fits:
        return f"{head}: {mine.label} does not fit the per-rank expert memory budget (--memory-gib)"
    if mine.comm_us > best.comm_us and mine.comm_us - best.comm_us >= best.experts_us - mine.experts_us:
        why = (f"{mine.label} spends {mine.comm_us:.1f} us/step moving rows, {best.label} {best.comm_us:.1f} us, "
               f"more than its sharded experts save ({mine.experts_us:.1f} vs {best.experts_us:.1f} us)")  # fmt: skip
    else:
        why = (f"{mine.label} computes its experts in {mine.experts_us:.1f} us/step, {best.label} in "
               f"{best.experts_us:.1f} us")  # fmt: skip
    return (f"{head}: {why}; {mine.total_us:.1f} vs {best.total_us:.1f} us in all (an estimate: a faster link, "
            "--link/--bandwidth-gbps, or tighter memory can change it)")
