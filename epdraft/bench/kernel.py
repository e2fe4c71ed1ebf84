"""`epdraft bench kernel`: fused experts vs torch._grouped_mm vs the reference loop, against the memory roofline.

With `--weights bf16,fp8,mxfp4` every shape and T runs in each weight format side by side, on the
same random weights (quantized by `epdraft.loading.quant`; fp8 with 128 x 128 blocks) and routing:
bytes count each format's stored values and scales, `x bf16` is the bf16 row's time over this one,
and the error is against `experts_reference` on the format's dequantized weights. grouped_mm and
the reference loop are timed for bf16 rows only. `mxfp4` runs as a loaded draft does: the bits
upcast on shift-packed bytes (`ExpertWeights.shift_packed`: the table-free decode; `mxfp4-shift`
names it too); `mxfp4-bits` is the bits upcast's table decode on checkpoint-order bytes and
`mxfp4-dot-scaled` `tl.dot_scaled`'s, so `--weights bf16,mxfp4-bits,mxfp4` times two on the same weights.

Every path runs on the same random routing; the fused and grouped_mm paths are timed as CUDA-graph
replays (median of `triton.testing.do_bench`), the reference loop eagerly (it synchronizes with the
host). `fused` is the whole forward; `align` the routing setup alone; `gemms` the fused forward
without it (both GEMMs and the top-k sum on a precomputed routing setup), the part comparable to
kernel-only timings of other fused-MoE kernels. `--shapes V41F --weights bf16,mxfp4` is DeepSeek-V4.1-Flash's
draft experts (FP4 as released, held as the kernels' mxfp4) against bf16. Bytes moved = distinct experts hit x 3*I*H*itemsize + x read + y written; the roofline is
the copy bandwidth measured on this kind of GPU (`bench.ceilings`: 4.3 TB/s on an H200, 3.0 on an H100). With `--tune`, the listed shapes are
tuned first and their tables written to `--config-dir`, which the benchmark then reads. `--skew 0.75`
tunes and times on routing that crowds a few experts, as a draft step's mask rows do (`random_routing`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
from pathlib import Path

import msgspec
import torch

from epdraft.config.ffn import ActivationSpec
from epdraft.errors import ConfigError
from epdraft.bench.ceilings import memory_bytes_per_s
from epdraft.bench.tune import graph_us, random_routing, tune
from epdraft.kernels.experts.fused import MXFP4_UPCAST
from epdraft.kernels.experts.tables import CONFIG_DIR, config_file_name, fit_format, get_config, save_table
from epdraft.kernels.experts.weights import ExpertWeights
from epdraft.layers.activations import gated_act
from epdraft.layers.experts import experts_reference
from epdraft.loading.quant import dequantize_weights, quantize_weights

log = logging.getLogger(__name__)

SHAPES: dict[str, tuple[int, int, int, int]] = {
    "A": (8, 1536, 4096, 1),
    "B": (8, 1536, 4096, 2),
    "C": (128, 2304, 5120, 3),
    "D": (512, 512, 5120, 10),
    "V41F": (128, 2304, 4096, 3),
}
"""Name -> (E experts, I per-expert intermediate, H hidden, k). `V41F` is DeepSeek-V4.1-Flash's DSpark
draft (`bench.step.DSPARK_PRESETS["v41-flash"]`; tests/bench/test_kernel_shapes.py holds them equal):
the shape whose FP4 experts issue 32 times against bf16 at T <= 128. It has no tuned table shipped
yet: `--tune V41F` writes one (without, the kernels run the documented default and warn once)."""


VARIANTS: dict[str, tuple[str, str, str]] = {
    "bf16": ("bf16", MXFP4_UPCAST, "nibbles"),
    "fp8": ("fp8", MXFP4_UPCAST, "nibbles"),
    "mxfp4": ("mxfp4", "bits", "shift"),
    "mxfp4-bits": ("mxfp4", "bits", "nibbles"),
    "mxfp4-shift": ("mxfp4", "bits", "shift"),
    "mxfp4-dot-scaled": ("mxfp4", "dot_scaled", "nibbles"),
}
"""`--weights` name -> (weight format, the kernels' mxfp4_upcast, MXFP4's byte packing; only MXFP4
reads the last two: "shift" is `ExpertWeights.shift_packed`, the bits upcast's table-free decode).
`mxfp4` is what a loaded draft runs (`RoutedExperts.pack_for_kernels`)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default="A,B,C,D", help=f"comma list of {', '.join(SHAPES)} (E, I, H, k)")
    parser.add_argument("--tokens", default="16,128,512,2048", help="comma list of token counts T")
    parser.add_argument("--tune", default="", metavar="SHAPE", help="comma list of shapes to tune before timing")
    parser.add_argument("--config-dir", type=Path, default=CONFIG_DIR, help="where tuned tables are read and written")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--weights", default="bf16",
                        help="comma list of weight formats: bf16, fp8, mxfp4 (as a loaded draft runs: the "
                             "shift decode), mxfp4-bits, mxfp4-shift, mxfp4-dot-scaled (one MXFP4 decode each)")
    parser.add_argument("--tune-weights", default="", help="formats --tune tunes (default: those of --weights; "
                        "at most one MXFP4 name: the tuned table is per format)")
    parser.add_argument("--skew", type=float, default=1.0,
                        help="routing of the tuning and timing: expert popularity SKEW^rank (1: uniform; issue 13's "
                             "draft step routes like ~0.75, its mask rows crowding a few experts)")
    parser.add_argument("--json", type=Path, default=None, help="append one JSON line per (shape, T) here")


def _parse_formats(text: str) -> list[str]:
    """`--weights` names in order, each known to `VARIANTS`."""
    names = [f for f in text.split(",") if f]
    unknown = [f for f in names if f not in VARIANTS]
    if unknown or not names:
        raise ConfigError(f"--weights: unknown format(s) {unknown or text!r}; known: {list(VARIANTS)}")
    return names


def _parse_shapes(text: str) -> list[str]:
    names = [s for s in text.split(",") if s]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        raise ConfigError(f"--shapes/--tune: unknown shape(s) {unknown}; known: {sorted(SHAPES)}")
    return names


def grouped_mm_experts(x_TH, ids_TK, weights_TK, w13_eNH, w2_eHF, act: ActivationSpec) -> torch.Tensor:
    """The `torch._grouped_mm` baseline: sort pairs, grouped gate_up, activation, grouped down, weighted scatter-add."""
    T, K = ids_TK.shape
    e, N, H = w13_eNH.shape
    flat = ids_TK.reshape(-1)
    key = torch.where(flat >= 0, flat, e)  # dropped pairs sort last, past every group
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(e + 1, dtype=torch.int32, device=x_TH.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offs = torch.cumsum(counts[:e], 0, dtype=torch.int32)
    token = order // K
    gate_up = torch._grouped_mm(x_TH[token], w13_eNH.transpose(1, 2), offs=offs)
    h = gated_act(gate_up[:, : N // 2], gate_up[:, N // 2 :], act).to(x_TH.dtype)
    down = torch._grouped_mm(h, w2_eHF.transpose(1, 2), offs=offs).float()
    keep = (key[order] < e).unsqueeze(1)
    contrib = torch.where(keep, down * weights_TK.reshape(-1)[order].float().unsqueeze(1), 0.0)
    return torch.zeros(T, H, dtype=torch.float32, device=x_TH.device).index_add_(0, token, contrib).to(x_TH.dtype)


def _bench_one(name: str, num_tokens: int, weights: tuple[ExpertWeights, ExpertWeights], dtype: torch.dtype,
               config_dir: Path, bf16: tuple[torch.Tensor, torch.Tensor] | None, upcast: str = MXFP4_UPCAST,
               skew: float = 1.0) -> dict:  # fmt: skip
    """One (shape, T, format) row. `bf16` holds the format's dequantized weights for the reference;
    None for bf16 rows, which also time grouped_mm and the reference loop. `upcast`: MXFP4's;
    `skew`: the routing's (`random_routing`)."""
    from triton.testing import do_bench

    from epdraft.kernels.experts.align import align_pairs
    from epdraft.kernels.experts.fused import down_combine, fused_experts_with_config, up_act

    E, I, H, K = SHAPES[name]
    w13, w2 = weights
    fmt = w13.format
    device = w13.values.device
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, H, device=device, generator=gen).to(dtype)
    ids, topk_w = random_routing(num_tokens, E, K, device, gen, skew)
    act = ActivationSpec()
    config = get_config(E, 2 * I, H, dtype, num_tokens, K, torch.cuda.get_device_name(device), config_dir, fmt)
    if fmt != "bf16":
        config = fit_format(config, fmt, w13.block[1], H, I)
    ref13, ref2 = bf16 if bf16 is not None else (w13.values, w2.values)

    def forward():
        return fused_experts_with_config(x, ids, topk_w, w13, w2, act, None, None, config, upcast)

    fused = forward()
    ref = experts_reference(x, ids, topk_w, ref13, ref2, act)
    scale = ref.float().abs().mean().item()
    err = (fused.float() - ref.float()).abs()

    # the first timing after a compile is discarded: on the H200 it ran up to 10 % slow (fp8 C T = 16:
    # 416 then 377 us, the same graph), as if the GPU were not yet at its clocks after the idle compile
    graph_us(forward)
    fused_us = graph_us(forward)
    align_us = graph_us(lambda: align_pairs(ids.view(-1), E, config.block_m))
    aligned = align_pairs(ids.view(-1), E, config.block_m)
    gemms_us = graph_us(
        lambda: down_combine(up_act(x, aligned, w13, None, act, config.up, upcast), aligned, ids, topk_w, w2, None,
                             config.down, upcast)
    )
    row = {}
    if fmt == "bf16":
        grouped = grouped_mm_experts(x, ids, topk_w, ref13, ref2, act)
        grouped_us = graph_us(lambda: grouped_mm_experts(x, ids, topk_w, ref13, ref2, act))
        ref_us = do_bench(lambda: experts_reference(x, ids, topk_w, ref13, ref2, act), warmup=5, rep=30,
                          return_mode="median") * 1e3
        row = {"grouped_mm_us": grouped_us, "reference_us": ref_us, "speedup_vs_grouped_mm": grouped_us / fused_us,
               "grouped_max_err_rel": (grouped.float() - ref.float()).abs().max().item() / scale}

    experts_hit = torch.unique(ids).numel()
    bytes_moved = experts_hit * (w13.nbytes + w2.nbytes) // E + 2 * num_tokens * H * x.element_size()
    flops = 2 * num_tokens * K * 3 * I * H
    return {
        "shape": name,
        "E": E,
        "I": I,
        "H": H,
        "k": K,
        "T": num_tokens,
        "dtype": str(dtype).removeprefix("torch."),
        "weights": fmt,
        **({"mxfp4_upcast": upcast, "mxfp4_packing": w13.packing} if fmt == "mxfp4" else {}),
        "config": msgspec.to_builtins(config),
        "fused_us": fused_us,
        "align_us": align_us,
        "gemms_us": gemms_us,
        **row,
        "experts_hit": experts_hit,
        "bytes": bytes_moved,
        "roofline_pct": 100 * bytes_moved / (fused_us * 1e-6) / memory_bytes_per_s(torch.cuda.get_device_name())[0],
        "tflops": flops / (fused_us * 1e-6) / 1e12,
        "max_err_rel": err.max().item() / scale,
        "mean_err_rel": err.mean().item() / scale,
    }


def _print_row(row: dict, bf16_us: float | None) -> None:
    upcast = "shift" if row.get("mxfp4_packing") == "shift" else row.get("mxfp4_upcast")
    weights = row["weights"] + ({"bits": "-bits", "shift": "-shift", "dot_scaled": "-dot-scaled"}[upcast]
                                if upcast else "")
    gmm = f"{row['grouped_mm_us']:>8.1f}" if "grouped_mm_us" in row else f"{'-':>8}"
    ref = f"{row['reference_us']:>9.1f}" if "reference_us" in row else f"{'-':>9}"
    vs = f"{bf16_us / row['fused_us']:>6.2f}" if bf16_us is not None else f"{'-':>6}"
    print(
        f"{row['shape']:>5} {row['T']:>5} {weights:>16} {row['fused_us']:>9.1f} {row['align_us']:>8.1f}"
        f" {row['gemms_us']:>8.1f} {gmm} {ref} {row['bytes'] / 1e6:>9.1f} {row['roofline_pct']:>6.1f}"
        f" {row['tflops']:>8.1f} {vs} {row['max_err_rel']:>8.4f}",
        flush=True,
    )


def main(args: argparse.Namespace) -> int:
    if not 0 < args.skew <= 1:
        raise ConfigError(f"--skew {args.skew}: the expert popularity ratio must be in (0, 1] (1: uniform routing)")
    import triton

    if not torch.cuda.is_available():
        raise ConfigError("epdraft bench kernel needs a CUDA device")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    tokens = [int(t) for t in args.tokens.split(",") if t]
    variants = _parse_formats(args.weights)
    formats = list(dict.fromkeys(VARIANTS[v][0] for v in variants))  # each format quantized once
    if dtype != torch.bfloat16 and formats != ["bf16"]:
        raise ConfigError("--weights fp8/mxfp4 need --dtype bf16 (bf16 activations)")
    device_name = torch.cuda.get_device_name()
    tuned = [VARIANTS[v] for v in _parse_formats(args.tune_weights or args.weights)] if args.tune else []
    if [fmt for fmt, _, _ in tuned].count("mxfp4") > 1:
        raise ConfigError("--tune-weights: name one MXFP4 upcast (mxfp4, mxfp4-bits, mxfp4-shift or mxfp4-dot-scaled); "
                          "the tuned table is one per format")
    for name in _parse_shapes(args.tune):
        E, I, H, K = SHAPES[name]
        for fmt, upcast, packing in tuned:
            table = tune(E, I, H, K, dtype, tokens, fmt, upcast, packing, args.skew)
            path = args.config_dir / config_file_name(E, 2 * I, H, dtype, device_name, fmt)
            save_table(table, path)
            log.info("tuned shape %s (%s weights) -> %s", name, fmt, path)
    meta = {
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
        "skew": args.skew,
    }
    rows = []
    header = f"{'shape':>5} {'T':>5} {'weights':>16} {'fused us':>9} {'align us':>8} {'gemms us':>8} {'gmm us':>8}"
    header += f" {'ref us':>9} {'bytes MB':>9}"
    header += f" {'%roof':>6} {'TFLOP/s':>8} {'x bf16':>6} {'max err':>8}"
    print(header)
    for name in _parse_shapes(args.shapes):
        E, I, H, K = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(1)
        w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) * H**-0.5).to(dtype)
        w2 = (torch.randn(E, H, I, device="cuda", generator=gen) * I**-0.5).to(dtype)
        stored = {fmt: (quantize_weights(w13, fmt), quantize_weights(w2, fmt)) for fmt in formats}
        del w13, w2
        for variant in variants:
            fmt, upcast, packing = VARIANTS[variant]
            q13, q2 = stored[fmt]
            reference = None if fmt == "bf16" else (dequantize_weights(q13, dtype), dequantize_weights(q2, dtype))
            if packing == "shift":
                q13, q2 = q13.shift_packed(), q2.shift_packed()
            for num_tokens in tokens:
                row = {**meta, **_bench_one(name, num_tokens, (q13, q2), dtype, args.config_dir, reference, upcast,
                                            args.skew)}  # fmt: skip
                rows.append(row)
                if args.json is not None:  # row by row: a run cut short keeps what it measured
                    with args.json.open("a") as f:
                        f.write(json.dumps(row) + "\n")
            del reference
        for num_tokens in tokens:  # printed grouped by T so the formats stand side by side
            base = [r for r in rows if (r["shape"], r["T"], r["weights"]) == (name, num_tokens, "bf16")]
            for row in (r for r in rows if (r["shape"], r["T"]) == (name, num_tokens)):
                _print_row(row, base[0]["fused_us"] if base else None)
        del stored
        torch.cuda.empty_cache()
    return 0
