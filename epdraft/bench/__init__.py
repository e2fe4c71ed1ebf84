"""`epdraft bench dispatch | iteration | kernel | linear | step | sync | transfer`: benchmarks as commands (JSON lines + a table).

Each sub-command lives in its own module (`epdraft.bench.dispatch`, `.iteration`, `.kernel`,
`.linear`, `.step`, `.sync`, `.transfer`)
exposing `add_arguments(parser)` and `main(args) -> int`; it is imported only when chosen, so one
benchmark's heavy or missing dependencies (Triton, Mooncake) never break the others.
"""

from __future__ import annotations

import argparse
import importlib

SUBCOMMANDS = {
    "dispatch": "MoE dispatch layouts on local CPU ranks: per-phase median step time",
    "iteration": "the engine's draft iteration (commit + propose) on one GPU, graph and eager, against its floor",
    "kernel": "fused-experts kernels against the reference and the memory roofline",
    "linear": "a DeepSeek draft's FP8 linears: bf16 GEMM on weights dequantized at load vs FP8 GEMM",
    "step": "the whole draft step on one GPU (cache, pooled eager, CUDA graph) against its floor",
    "sync": "the step sync on 2-16 local CPU ranks: median ms per sync against W = 2",
    "transfer": "target-feature transfer between ranks (torch p2p, Mooncake)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    lines = "\n".join(f"  {name:<10}{text}" for name, text in SUBCOMMANDS.items())
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = f"benchmarks:\n{lines}\n\n`epdraft bench WHAT --help` lists WHAT's options."
    parser.add_argument("what", choices=sorted(SUBCOMMANDS), help="which benchmark")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options")


def main(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"epdraft.bench.{args.what}")
    parser = argparse.ArgumentParser(prog=f"epdraft bench {args.what}", description=module.__doc__)
    module.add_arguments(parser)
    return module.main(parser.parse_args(args.options))
