"""Side by side in one process: the fused-experts GEMMs on the shipped H200 tables' tiles with
per-thread weight loads and with TMA weight-tile copies (`weight_tma` set in every entry). The
tables are copied under this GPU's name, so an H100 runs the same tiles.

    python tools/tma_compare.py [--shapes A,B,C] [--tokens 16,128,512] [--weights bf16,fp8,mxfp4]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

import msgspec

from epdraft.bench import kernel as bench
from epdraft.kernels.experts.tables import CONFIG_DIR, MoeKernelConfig, load_table, save_table
from epdraft.loading.quant import dequantize_weights, quantize_weights


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="A,B,C")
    p.add_argument("--tokens", default="16,128,512")
    p.add_argument("--weights", default="bf16,fp8,mxfp4")
    args = p.parse_args()
    name = torch.cuda.get_device_name().replace(" ", "_")
    threads, tma = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp())
    for f in CONFIG_DIR.glob("*NVIDIA_H200.json"):
        shutil.copy(f, threads / f.name.replace("NVIDIA_H200", name))
        table = {m: _with_tma(c) for m, c in load_table(f).items()}
        save_table(table, tma / f.name.replace("NVIDIA_H200", name))
    print(f"{'shape':>5} {'T':>5} {'weights':>7} {'threads us':>10} {'tma us':>8} {'x':>6} {'threads %roof':>13} "
          f"{'tma %roof':>9} {'max err thr/tma':>16}")
    for shape in args.shapes.split(","):
        E, I, H, K = bench.SHAPES[shape]
        gen = torch.Generator(device="cuda").manual_seed(1)
        w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) * H**-0.5).bfloat16()
        w2 = (torch.randn(E, H, I, device="cuda", generator=gen) * I**-0.5).bfloat16()
        for fmt in args.weights.split(","):
            q = (quantize_weights(w13, fmt), quantize_weights(w2, fmt))
            ref = None if fmt == "bf16" else (dequantize_weights(q[0], torch.bfloat16), dequantize_weights(q[1], torch.bfloat16))
            for T in (int(t) for t in args.tokens.split(",")):
                a, b = (bench._bench_one(shape, T, q, torch.bfloat16, tables, ref) for tables in (threads, tma))
                print(f"{shape:>5} {T:>5} {fmt:>7} {a['fused_us']:>10.1f} {b['fused_us']:>8.1f} "
                      f"{a['fused_us'] / b['fused_us']:>6.2f} {a['roofline_pct']:>13.1f} {b['roofline_pct']:>9.1f} "
                      f"{a['max_err_rel']:>8.4f}/{b['max_err_rel']:.4f}", flush=True)
            del q, ref
        del w13, w2
        torch.cuda.empty_cache()


def _with_tma(config: MoeKernelConfig) -> MoeKernelConfig:
    return msgspec.structs.replace(config, up=msgspec.structs.replace(config.up, weight_tma=True),
                                   down=msgspec.structs.replace(config.down, weight_tma=True))


if __name__ == "__main__":
    main()
