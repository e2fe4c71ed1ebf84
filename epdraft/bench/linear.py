"""`epdraft bench linear`: a DeepSeek DSpark draft's FP8 linears, as a bf16 GEMM on weights dequantized at
load vs an FP8 GEMM run every step (issue 32: choose by measuring both).

DeepSeek releases the draft's linears (attention, shared expert, main_proj) in FP8 e4m3 with e8m0
block scales; loading dequantizes them to bf16 today, so each step reads 2 bytes a weight. An FP8
GEMM reads 1 byte (and the scales) but must first cast its activation to FP8 with one scale per 1 x 128
group (DeepSeek's `act_quant`, power-of-two scales under `scale_fmt: ue8m0`), every call. For each linear
of the preset's draft (shapes read from the built layers, `draft_linears`) and each T rows (`--rows`:
N requests x block 5 at N 1, 8, 32, 64 by default) it times, side by side (CUDA events, median of
`--steps` after `--warmup`, timed in turn by `bench.step.time_alternately_ms`):

    bf16 us    the bf16 GEMM on the dequantized weights (`F.linear`; o_a_proj: the model's grouped einsum)
    fp8 us     activation quantization + the FP8 GEMM: what a step would pay
    quant us   the activation quantization alone (torch, compiled by torch.compile; `--quant eager`: not)
    gemm us    the FP8 GEMM alone, on an activation quantized beforehand

Each timing is one call's share of `calls` back-to-back calls captured in one CUDA graph (no launch
gaps), cycling over copies of the weights that together exceed three L2 caches, so every call reads
its weights from HBM as a step does. The FP8 GEMM is cuBLAS's DeepSeek recipe through
`torch.nn.functional.scaled_mm` (activation `BlockWise1x128`, weights `BlockWise128x128`; sm90,
CUDA >= 12.9) when a small trial GEMM runs and matches here; otherwise `torch._scaled_mm` with row-wise
scales (one per activation row and weight row) stands in as the FP8 GEMM's speed proxy. The header
says which ran and why (`--gemm` forces one); a shape the chosen GEMM refuses prints its error in its row
(JSON: `error`) and the run goes on. o_a_proj is G block-diagonal GEMMs (o_groups): the FP8
side runs G GEMMs (outputs not concatenated), the bf16 side one einsum.

Weights are random, quantized with the project's quantizer (`loading.quant.quantize_fp8`, 128 x 128
blocks, e8m0 scales: V4's release; V4.1's draft ships 32 x 32 blocks, which cuBLAS's recipe cannot
read: an FP8 GEMM for it needs its scales re-blocked or its own kernel). `err` is the FP8 result's
relative error (Frobenius norm) against the bf16 GEMM of the same dequantized weights. Floors are
weight bytes / the copy bandwidth measured on this kind of GPU (`bench.ceilings`): bf16 bytes, and FP8
values + fp32 scales (what the GEMM reads). `per step` sums the layers' linears (x num_layers; main_proj
runs on the context at extend, not in the step). Prints a table and one JSON line per point (`--json
FILE` appends them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch

from epdraft.bench.ceilings import memory_bytes_per_s
from epdraft.errors import ConfigError

FP8_MAX = 448.0
ACT_GROUP = 128
"""Activation values per scale: DeepSeek's `act_quant` block, cuBLAS's BlockWise1x128."""
WEIGHT_BLOCK = (128, 128)


class LinearShape(msgspec.Struct, frozen=True, kw_only=True):
    """One linear of a draft layer: `groups` block-diagonal GEMMs of weight [out_features, in_features]
    each (o_a_proj: o_groups; else 1) on x [T, groups * in_features]. `per_step`: how many run in one
    draft step (the layer count; 0 for main_proj, which runs at extend)."""

    name: str
    out_features: int
    in_features: int
    groups: int = 1
    per_step: int

    @property
    def bf16_bytes(self) -> int:
        """Bytes of the weight held in bf16 (dequantized at load)."""
        return 2 * self.groups * self.out_features * self.in_features

    @property
    def fp8_bytes(self) -> int:
        """Bytes an FP8 GEMM reads of the weight: e4m3 values plus one fp32 scale per 128 x 128 block."""
        bn, bk = WEIGHT_BLOCK
        blocks = math.ceil(self.out_features / bn) * math.ceil(self.in_features / bk)
        return self.groups * (self.out_features * self.in_features + 4 * blocks)


def draft_linears(spec) -> list[LinearShape]:
    """The non-expert linears of a DeepSeek DSpark draft (`spec.deepseek` set), read from its layer 0
    built on the meta device: q_a_proj, q_b_proj, kv_proj, o_a_proj (grouped), o_b_proj, the shared
    expert's w1 / w3 / w2, main_proj. Raises ConfigError for another kind of draft."""
    from epdraft.models.deepseek_dspark import DeepseekDSparkDraft

    if spec.deepseek is None:
        raise ConfigError(f"bench linear: FP8 linears are DeepSeek's release; the draft is kind {spec.kind!r}, "
                          "expected a DeepSeek DSpark (dspark_v4) draft such as --preset v41-flash")
    draft = DeepseekDSparkDraft(spec, dtype=torch.bfloat16, device="meta")
    layer, L = draft.layers[0], spec.num_layers
    attn = layer.attn
    out: list[LinearShape] = []
    for name in ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj"):
        N, K = getattr(attn, name).weight.shape
        G = attn.o_groups if name == "o_a_proj" else 1
        out.append(LinearShape(name=name, out_features=N // G, in_features=K, groups=G, per_step=L))
    shared = getattr(layer.mlp, "shared", None)
    if shared is not None:
        projections = (("shared.w1", shared.gate_proj), ("shared.w3", shared.up_proj), ("shared.w2", shared.down_proj))
        for name, proj in projections:
            N, K = proj.weight.shape
            out.append(LinearShape(name=name, out_features=N, in_features=K, per_step=L))
    N, K = draft.main_proj.weight.shape
    out.append(LinearShape(name="main_proj", out_features=N, in_features=K, per_step=0))
    return out


def floor_us(nbytes: int, bytes_per_s: float) -> float:
    """µs to read `nbytes` once at `bytes_per_s`."""
    return nbytes / bytes_per_s * 1e6


def quantize_activation_groups(
    x_TK: torch.Tensor, group: int, ue8m0: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """x_TK [T, K] (K % group == 0) -> (float8_e4m3fn [T, K], fp32 scales_GT [K / group, T] contiguous).

    One scale per `group` values of a row: amax / 448 (amax floored at 1e-4, as DeepSeek's `act_quant`),
    with `ue8m0` rounded up to a power of two; value = fp8 * scale. `scales_GT.t()` is the [T, K / group]
    outer-dim-major scale tensor cuBLAS's BlockWise1x128 recipe takes; with group = K it is the [T, 1]
    row-wise scale.
    """
    T, K = x_TK.shape
    g_TGk = x_TK.float().view(T, K // group, group)
    amax_TG = g_TGk.abs().amax(dim=-1).clamp_min(1e-4)
    scale_TG = amax_TG / FP8_MAX
    if ue8m0:
        scale_TG = torch.exp2(torch.ceil(torch.log2(scale_TG)))
    q_TK = (g_TGk / scale_TG.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(T, K)
    return q_TK, scale_TG.t().contiguous()


def blockwise_weight_scale(scale_nk: torch.Tensor) -> torch.Tensor:
    """A weight's fp32 block scales [ceil(N/128), L] (L = ceil(K/128)) as cuBLAS's BlockWise128x128 recipe
    takes them for mat_b = weight.t(): [L4, ceil(N/128)], L-major in memory (stride (1, L4)), L padded with
    zeros to L4, a multiple of 4 (cuBLAS's 128 x 128 scale layout)."""
    pad = -scale_nk.shape[-1] % 4
    return torch.nn.functional.pad(scale_nk.float(), (0, pad)).t()


class Fp8Weight(msgspec.Struct, frozen=True):
    """A [G, N, K] weight as each GEMM reads it: `dequantized` bf16 (the loader's), and the FP8 GEMM's
    per group `values` [N, K] e4m3 and `scale_b` (blockwise: `blockwise_weight_scale`; rowwise: [1, N])."""

    dequantized: torch.Tensor
    values: tuple[torch.Tensor, ...]
    scale_b: tuple[torch.Tensor, ...]


def fp8_weight(w_GNK: torch.Tensor, gemm: str) -> Fp8Weight:
    """`w_GNK` quantized as DeepSeek releases it (128 x 128 blocks, e8m0 scales), dequantized for the bf16
    side; the FP8 side holds those blocks (`gemm` "blockwise") or, for the row-wise proxy, the dequantized
    weight re-quantized with one scale per row (its error then includes that re-quantization)."""
    from epdraft.loading.quant import dequantize_fp8, e8m0_to_float, quantize_fp8

    q, s = quantize_fp8(w_GNK, WEIGHT_BLOCK, ue8m0=True)
    deq = dequantize_fp8(q, s, WEIGHT_BLOCK, torch.bfloat16)
    if gemm == "blockwise":
        s32 = e8m0_to_float(s)
        return Fp8Weight(deq, tuple(q.unbind(0)), tuple(blockwise_weight_scale(s32[g]) for g in range(len(q))))
    rows = [quantize_activation_groups(deq[g], deq.shape[-1], ue8m0=False) for g in range(len(deq))]
    return Fp8Weight(deq, tuple(q for q, _ in rows), tuple(s_1N for _, s_1N in rows))  # scales [1, N] each


def fp8_gemm(kind: str, a_TK: torch.Tensor, scales_GT: torch.Tensor, b_NK: torch.Tensor, scale_b: torch.Tensor):
    """a [T, K] e4m3 (its scales `scales_GT` as `quantize_activation_groups` returns them) @ b [N, K].t() -> bf16 [T, N]."""
    if kind == "blockwise":
        F = torch.nn.functional
        return F.scaled_mm(a_TK, b_NK.t(), scales_GT.t(), F.ScalingType.BlockWise1x128, scale_b,
                           F.ScalingType.BlockWise128x128, swizzle_a=F.SwizzleType.NO_SWIZZLE,
                           swizzle_b=F.SwizzleType.NO_SWIZZLE, output_dtype=torch.bfloat16)  # fmt: skip
    return torch._scaled_mm(a_TK, b_NK.t(), scale_a=scales_GT.t(), scale_b=scale_b, out_dtype=torch.bfloat16)


def _fp8_groups(kind: str, q_TK, s_GT, w: Fp8Weight, K: int) -> list[torch.Tensor]:
    """The FP8 GEMM of each weight group on its slice of the quantized activation."""
    per = K // ACT_GROUP if kind == "blockwise" else 1  # scale rows per group
    return [fp8_gemm(kind, q_TK[:, g * K:(g + 1) * K], s_GT[g * per:(g + 1) * per], w.values[g], w.scale_b[g])
            for g in range(len(w.values))]  # fmt: skip


def _bf16(x_TK: torch.Tensor, w_GNK: torch.Tensor) -> torch.Tensor:
    if w_GNK.shape[0] == 1:
        return torch.nn.functional.linear(x_TK, w_GNK[0])
    G, _, K = w_GNK.shape
    return torch.einsum("tgi,gri->tgr", x_TK.view(-1, G, K), w_GNK)  # the model's o_a_proj


def choose_gemm(asked: str, device: torch.device) -> tuple[str, str]:
    """("blockwise" | "rowwise", why): `asked` "auto" tries cuBLAS's DeepSeek recipe on a 16 x 256 x 256
    GEMM and checks it against the dequantized product; "blockwise" / "rowwise" run as asked."""
    if asked == "rowwise":
        return "rowwise", "--gemm rowwise"
    F = torch.nn.functional
    if not all(hasattr(F, n) for n in ("scaled_mm", "ScalingType", "SwizzleType")):
        reason = f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    else:
        try:
            gen = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(16, 256, device=device, generator=gen).bfloat16()
            w = fp8_weight(torch.randn(1, 256, 256, device=device, generator=gen) / 16, "blockwise")
            q, s = quantize_activation_groups(x, ACT_GROUP)
            got = fp8_gemm("blockwise", q, s, w.values[0], w.scale_b[0]).float()
            want = _bf16(x, w.dequantized).float()
            err = ((got - want).norm() / want.norm()).item()
            reason = None if err < 0.1 else f"its trial GEMM is off by {err:.2g} (relative)"
        except (RuntimeError, NotImplementedError, TypeError) as e:  # cuBLAS / torch refusing the recipe here
            reason = " ".join(str(e).split())[:200]
    if reason is None:
        return "blockwise", "cuBLAS 1x128 x 128x128 block scales (torch.nn.functional.scaled_mm) run here"
    if asked == "blockwise":
        raise ConfigError(f"--gemm blockwise: the block-scaled FP8 GEMM does not run here: {reason}")
    return "rowwise", ("row-wise torch._scaled_mm as the FP8 GEMM's speed proxy: block scales do not run here "
                       f"({reason})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from epdraft.bench.step import DSPARK_PRESETS

    parser.add_argument("--preset", choices=sorted(DSPARK_PRESETS), default="v41-flash",
                        help="the DeepSeek DSpark draft whose linears are timed (default v41-flash)")
    parser.add_argument("--draft", type=Path, help="a DSpark V4 draft export directory instead (its config.json only)")
    parser.add_argument("--rows", default="5,40,160,320", help="rows T per GEMM, comma list (default: N x block 5 "
                        "at N 1, 8, 32, 64)")
    parser.add_argument("--linears", default="", help="comma list of linear names (default: all)")
    parser.add_argument("--gemm", choices=("auto", "blockwise", "rowwise"), default="auto",
                        help="the FP8 GEMM: cuBLAS's block-scaled DeepSeek recipe, the row-wise proxy, or "
                        "auto (block-scaled when it runs here, saying why not otherwise)")
    parser.add_argument("--quant", choices=("compiled", "eager"), default="compiled",
                        help="the activation quantizer: torch.compile'd (fused, default) or eager torch")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", type=Path, help="append one JSON line per (linear, T) to this file")


def _rows(text: str) -> list[int]:
    try:
        rows = [int(t) for t in text.split(",") if t]
    except ValueError:
        raise ConfigError(f"--rows {text!r}: expected a comma list of integers") from None
    if not rows or min(rows) < 1:
        raise ConfigError(f"--rows {text!r}: expected integers >= 1")
    return rows


def select_linears(spec, names: str) -> list[LinearShape]:
    """`draft_linears(spec)`, only those `names` lists (comma list; empty: all); ConfigError naming unknown ones."""
    linears = draft_linears(spec)
    wanted = [n for n in names.split(",") if n]
    unknown = sorted(set(wanted) - {lin.name for lin in linears})
    if unknown:
        raise ConfigError(f"--linears: unknown {unknown}; this draft's: {[lin.name for lin in linears]}")
    return [lin for lin in linears if not wanted or lin.name in wanted]


def _graph(fn: Callable[[int], object], calls: int) -> torch.cuda.CUDAGraph:
    """`fn(0) ... fn(calls - 1)` captured back to back in one CUDA graph, after one eager run of each
    distinct input on a side stream (compilation and cuBLAS's first-call setup stay out)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(0)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return graph


def _bench_point(lin: LinearShape, T: int, gemm: str, quant, args, l2_bytes: int, bytes_per_s: float) -> dict:
    """One (linear, T) row: the four timings, the FP8 result's error, the floors."""
    from epdraft.bench.step import time_alternately_ms

    device = torch.device("cuda", torch.cuda.current_device())
    G, N, K = lin.groups, lin.out_features, lin.in_features
    gen = torch.Generator(device=device).manual_seed(T)
    x = torch.randn(T, G * K, device=device, generator=gen).bfloat16()
    w = fp8_weight(torch.randn(G, N, K, device=device, generator=gen) * K**-0.5, gemm)
    copies = max(2, math.ceil(3 * l2_bytes / lin.fp8_bytes))  # each call reads a weight the L2 does not hold
    calls = max(copies, 20)
    deq = [w.dequantized.clone() for _ in range(copies)]
    fp8 = [Fp8Weight(w.dequantized, tuple(v.clone() for v in w.values), w.scale_b) for _ in range(copies)]
    group = ACT_GROUP if gemm == "blockwise" else K
    q0, s0 = quant(x, group)
    want = _bf16(x, w.dequantized).float().reshape(T, -1)
    got = torch.cat(_fp8_groups(gemm, q0, s0, w, K), dim=1).float()
    err = ((got - want).norm() / want.norm()).item()
    graphs = [
        _graph(lambda i: _bf16(x, deq[i % copies]), calls),
        _graph(lambda i: _fp8_groups(gemm, *quant(x, group), fp8[i % copies], K), calls),
        _graph(lambda i: quant(x, group), calls),
        _graph(lambda i: _fp8_groups(gemm, q0, s0, fp8[i % copies], K), calls),
    ]
    bf16_ms, fp8_ms, quant_ms, gemm_ms = time_alternately_ms([g.replay for g in graphs], args.steps, args.warmup)
    del graphs, deq, fp8
    return dict(kind="linear", linear=lin.name, N=N, K=K, groups=G, per_step=lin.per_step, T=T,
                bf16_us=1e3 * bf16_ms / calls, fp8_us=1e3 * fp8_ms / calls, act_quant_us=1e3 * quant_ms / calls,
                fp8_gemm_us=1e3 * gemm_ms / calls, bf16_bytes=lin.bf16_bytes, fp8_bytes=lin.fp8_bytes,
                floor_bf16_us=floor_us(lin.bf16_bytes, bytes_per_s), floor_fp8_us=floor_us(lin.fp8_bytes, bytes_per_s),
                rel_err=err, weight_copies=copies, calls=calls)  # fmt: skip


def _quantizer(kind: str):
    """quant(x, group) -> (fp8, scales_GT): `quantize_activation_groups`, compiled (static shapes) unless eager."""
    return quantize_activation_groups if kind == "eager" else torch.compile(quantize_activation_groups, dynamic=False)


def main(args: argparse.Namespace) -> int:
    from epdraft.bench.step import preset_draft_config
    from epdraft.config.hf import read_config_json
    from epdraft.models.spec import DraftModelSpec

    rows = _rows(args.rows)
    config = read_config_json(args.draft) if args.draft else preset_draft_config(args.preset)
    spec = DraftModelSpec.from_config(config)
    linears = select_linears(spec, args.linears)
    if not torch.cuda.is_available():
        raise ConfigError("epdraft bench linear times GPU GEMMs (bf16 vs FP8): it needs CUDA")
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name()
    gemm, why = choose_gemm(args.gemm, device)
    quant = _quantizer(args.quant)
    bytes_per_s, ceiling = memory_bytes_per_s(name)
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    label = str(args.draft) if args.draft else args.preset
    meta = dict(preset=label, fp8_gemm=gemm, quantizer=args.quant, device=name, torch=torch.__version__,
                date=datetime.date.today().isoformat())  # fmt: skip
    print(f"draft {label} linears on {name}, torch {torch.__version__}; FP8 GEMM: {gemm}: {why}; activation "
          f"quantizer {args.quant}; floors at the {ceiling}")
    print(f"{'linear':>10} {'N x K':>12} {'G':>2} {'T':>4} {'bf16 us':>8} {'fp8 us':>8} {'quant us':>8} {'gemm us':>8}"
          f" {'fp8/bf16':>8} {'floor bf16':>10} {'floor fp8':>9} {'err':>8}")  # fmt: skip
    import torch._dynamo as dynamo

    # one static-shape compile of the quantizer per (T, K): lift dynamo's recompile limit (8 per function) for
    # this run, or the later shapes would run it eager (torch < 2.7 calls the limit cache_size_limit)
    limit = "recompile_limit" if hasattr(dynamo.config, "recompile_limit") else "cache_size_limit"
    with dynamo.config.patch(**{limit: 8 + 2 * len(rows) * len(linears)}):
        results = _run(linears, rows, gemm, quant, args, l2_bytes, bytes_per_s, meta)
    for T, (bf16, fp8, floor16, floor8) in step_sums(results).items():
        print(f"per step, T {T:>4}: bf16 {bf16:8.1f} us, fp8 {fp8:8.1f} us ({fp8 / bf16:.2f}x); "
              f"floors {floor16:.1f} / {floor8:.1f} us (the layers' linears x their count; main_proj left out)")
    return 0


def _run(linears, rows, gemm, quant, args, l2_bytes, bytes_per_s, meta) -> list[dict]:
    """Every (linear, T) row, printed and appended to --json as measured (a run cut short keeps them)."""
    results = []
    for lin in linears:
        for T in rows:
            try:
                row = {**meta, **_bench_point(lin, T, gemm, quant, args, l2_bytes, bytes_per_s)}
            except (RuntimeError, ValueError, NotImplementedError) as e:  # cuBLAS refusing one shape: say so, go on
                error = " ".join(str(e).split())[:300]
                print(f"{lin.name:>10} {f'{lin.out_features}x{lin.in_features}':>12} {lin.groups:>2} {T:>4}  "
                      f"{gemm} FP8 GEMM failed: {error}", flush=True)  # fmt: skip
                row = {**meta, "kind": "linear", "linear": lin.name, "T": T, "error": error}
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
                continue
            results.append(row)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
            print(f"{lin.name:>10} {f'{lin.out_features}x{lin.in_features}':>12} {lin.groups:>2} {T:>4}"
                  f" {row['bf16_us']:>8.1f} {row['fp8_us']:>8.1f} {row['act_quant_us']:>8.1f} {row['fp8_gemm_us']:>8.1f}"
                  f" {row['fp8_us'] / row['bf16_us']:>8.2f} {row['floor_bf16_us']:>10.1f} {row['floor_fp8_us']:>9.1f}"
                  f" {row['rel_err']:>8.4f}", flush=True)  # fmt: skip
            torch.cuda.empty_cache()
    return results


def step_sums(rows: list[dict]) -> dict[int, tuple[float, float, float, float]]:
    """T -> (bf16 µs, fp8 µs, bf16 floor µs, fp8 floor µs) of one step's linears: each row's times x its
    `per_step` count, summed over the rows at that T."""
    sums: dict[int, list[float]] = {}
    for r in rows:
        acc = sums.setdefault(r["T"], [0.0, 0.0, 0.0, 0.0])
        for i, key in enumerate(("bf16_us", "fp8_us", "floor_bf16_us", "floor_fp8_us")):
            acc[i] += r["per_step"] * r[key]
    return {T: tuple(v) for T, v in sums.items()}
