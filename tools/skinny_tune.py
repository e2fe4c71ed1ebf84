"""Time the draft step's dense projections on the GPU: the skinny Triton launches over a grid of
tile configs against cuBLAS (torch.nn.functional.linear), at the step's row counts.

    python tools/skinny_tune.py [--rows 16,32,128] [--quick]
    python tools/skinny_tune.py --splits [--rows 16,32]   # the default config at each K split
    python tools/skinny_tune.py --splits --no-pdl          # the same, launched without PDL (no weight prefetch)
    python tools/skinny_tune.py --wide --rows 64,128 --shapes 4096  # wide column tiles x K splits, for many rows
    python tools/skinny_tune.py --wide --quick --smem 200 --rows 128 --shapes issue13  # 24 wide tiles, deeper stages


Each timing is a CUDA graph of 24 back-to-back calls cycling over 4 copies of the weights (more
bytes than the L2 holds, so every call reads its weight from HBM), replayed 20 times: the median
replay / 24 is one call's GPU time without the host's launch cost. Prints, per projection: the
weight bytes' floor at this GPU's copy rate (`bench.ceilings`), cuBLAS, the config the device runs
now and the best config found; then, per row count, the configs with the least summed time over
each draft shape's projections ("step mix": what `skinny.DEVICE_CONFIGS` holds one of per GPU).
The mix is a shortlist, not the verdict: calls of one projection back to back are not the step,
where a norm runs before each and the commit's projections run other shapes (on an H100 the mix's
best left the step as it was and slowed the commit). Put a config in DEVICE_CONFIGS only after
`epdraft bench iteration` with and without it, side by side on one machine.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json

import torch
import torch.nn.functional as F

from epdraft.bench.ceilings import memory_bytes_per_s
from epdraft.bench.tune import calls_us
from epdraft.kernels import launch
from epdraft.kernels.step import skinny

COPIES, CALLS = 4, 24
# (bench step preset, name, K, output widths): issue13 (H 4096, 32/8 heads, 1536), v4like (H 5120, 40/8, 2304)
SHAPES = [
    ("issue13", "qkv 4096", 4096, (4096, 1024, 1024)), ("issue13", "o 4096", 4096, (4096,)),
    ("issue13", "gate_up 4096x1536", 4096, (1536, 1536)), ("issue13", "down 1536", 1536, (4096,)),
    ("v4like", "qkv 5120", 5120, (5120, 1024, 1024)), ("v4like", "o 5120", 5120, (5120,)),
    ("v4like", "gate_up 5120x2304", 5120, (2304, 2304)), ("v4like", "down 2304", 2304, (5120,)),
]  # fmt: skip


def _selected(shapes: str) -> list[tuple]:
    """SHAPES whose preset is one of the comma list `shapes`, or whose name holds one of it."""
    keys = shapes.split(",")
    return [s for s in SHAPES if any(k == s[0] or k in s[1] for k in keys)]


def _graph_us(fn) -> float:
    """One call's µs (`calls_us` over CALLS calls cycling COPIES weights); inf for a config past the
    shared memory (not a candidate)."""
    try:
        fn(0)
    except Exception as e:
        if "out of resource" not in str(e):
            raise
        return float("inf")
    return calls_us(lambda i: fn(i % COPIES), CALLS)


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="16,32,128")
    p.add_argument("--quick", action="store_true", help="fewer configs (with --wide: 24 wide tiles at splits 2-8)")
    p.add_argument("--wide", action="store_true",
                   help="wide column tiles (BLOCK_N 64-256) at K splits 1, 2, 4, 8: where 64-128 rows make the x tile "
                   "as large as the weight's")  # fmt: skip
    p.add_argument("--shapes", default="",
                   help="comma list: only these presets' projections (issue13, v4like) or those whose name holds one")
    p.add_argument("--smem", type=int, default=0,
                   help="KiB the candidate tiles' stages of x and weight tiles may take before BLOCK_K is halved "
                   "(default the launches' own, skinny._SMEM_BYTES): wide tiles at 128 rows past its 96 KiB; the "
                   "check and the shipped config run as shipped")  # fmt: skip
    p.add_argument("--json", default="", help="append every config's time to this JSON-lines file")
    p.add_argument("--splits", action="store_true", help="the default config at K splits 1, 2, 4, 8 and the automatic one")
    p.add_argument("--no-pdl", action="store_true",
                   help="launch without programmatic dependent launch: back-to-back calls of one projection then do "
                   "not prefetch the next call's weights while the current one streams")  # fmt: skip
    args = p.parse_args()
    if args.smem and args.splits:
        p.error("--smem sets the candidate tiles' budget; --splits times the shipped config only")
    with launch.pdl_off() if args.no_pdl else contextlib.nullcontext():
        if args.splits:
            return _splits([int(r) for r in args.rows.split(",")])
        return _configs(args)


@contextlib.contextmanager
def _smem_budget(kib: int):
    """The skinny launches' shared-memory budget for their pipelined tiles set to `kib` KiB (0: as
    shipped) while inside: a dev knob on the module's private value, which no launch takes as an
    argument."""
    shipped = skinny._SMEM_BYTES
    skinny._SMEM_BYTES = kib * 1024 or shipped
    try:
        yield
    finally:
        skinny._SMEM_BYTES = shipped


def _configs(args: argparse.Namespace) -> None:
    """Every tile config of the grid against cuBLAS and the device's config, per projection and row
    count; then the step mix."""
    configs = [(c, None) for c in itertools.product((16, 32), (128, 256, 512), (4, 8), (3, 4, 5))]
    if args.quick:
        configs = [(c, None) for c in itertools.product((16, 32), (128, 256, 512), (4, 8), (3, 4))]
    if args.wide:
        grid = ((64, 128, 256), (64, 128), (4, 8), (3, 4), (1, 2, 4, 8))
        if args.quick:
            grid = ((128, 256), (64, 128), (8,), (3, 4), (2, 4, 8))
        configs = [((n, k, w, s), split) for n, k, w, s, split in itertools.product(*grid)]
    hbm, ceiling = memory_bytes_per_s(torch.cuda.get_device_name())
    current = skinny._device_config(torch.device("cuda"))
    print(f"floors at the {ceiling}; the device's config now {current}")
    print(f"{'projection':>20}{'T':>5}{'floor us':>10}{'cublas':>9}{'current':>9}{'best':>9}"
          "  best config ((BN, BK, warps, stages), split)")
    shapes = _selected(args.shapes)
    mix: dict[tuple[str, int], dict[tuple, float]] = {}  # (preset, T) -> config -> summed µs
    for (preset, name, K, widths), T in itertools.product(shapes, [int(r) for r in args.rows.split(",")]):
        x = torch.randn(T, K, device="cuda").bfloat16()
        ws = [[torch.randn(n, K, device="cuda").bfloat16() for n in widths] for _ in range(COPIES)]
        floor = sum(widths) * K * 2 / hbm * 1e6
        gate_up = name.startswith("gate_up")
        if gate_up:
            ref = F.silu(F.linear(x, ws[0][0]).float()) * F.linear(x, ws[0][1]).float()
            got = skinny.gate_up_act(x, ws[0][0], ws[0][1], True, 0.0, 1.0)
        else:
            ref = torch.cat([F.linear(x, w) for w in ws[0]], 1)
            got = skinny.linear(x, ws[0])
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=5e-2)  # one bf16 rounding of the products

        def run(cfg, split=None):
            if gate_up:
                return lambda i: skinny.gate_up_act(x, ws[i][0], ws[i][1], True, 0.0, 1.0, config=cfg, split_k=split)
            return lambda i: skinny.linear(x, ws[i], config=cfg, split_k=split)

        def launched_as(cfg):
            return skinny._launch_config(cfg, max(16, 1 << (T - 1).bit_length()), 2 if gate_up else 1)

        cublas = _graph_us(lambda i: [F.linear(x, w) for w in ws[i]])
        now = _graph_us(run(current))
        with _smem_budget(args.smem):  # the candidates only: the check and `current` run as shipped
            launched: dict[tuple, list[tuple]] = {}  # configs that launch alike (BLOCK_K halved to fit) timed once
            for cfg, split in configs:
                launched.setdefault((launched_as(cfg), split), []).append((cfg, split))
            timed = [(_graph_us(run(*alike[0])), c) for alike in launched.values() for c in alike]
            best = min(timed, key=lambda t: t[0])
            ran = launched_as(best[1][0])
        if args.json:
            with open(args.json, "a") as f:
                for us, (cfg, split) in timed:
                    f.write(json.dumps({"projection": name, "T": T, "config": cfg, "split": split, "us": us,
                                        "cublas": cublas, "floor": floor}) + "\n")  # fmt: skip
        totals = mix.setdefault((preset, T), {})
        for us, c in timed:
            totals[c] = totals.get(c, 0.0) + us
        note = "" if ran == best[1][0] else f" (ran as {ran}: shared memory)"
        print(f"{name:>20}{T:>5}{floor:>10.1f}{cublas:>9.1f}{now:>9.1f}{best[0]:>9.1f}  {best[1]}{note}", flush=True)
    for (preset, T), totals in sorted(mix.items()):
        ranked = sorted((us, c) for c, us in totals.items())[:3]
        print(f"step mix {preset} T {T}: " + "  ".join(f"{c} {us:.1f} us" for us, c in ranked)
              + f"  (the device's config{' at --smem' if args.smem else ''}: "
              f"{totals.get((current, None), float('nan')):.1f} us)")


def _splits(rows: list[int]) -> None:
    """Per projection and row count: cuBLAS, then the device's tile config at each K split, and the
    split `skinny.choose_split` takes (what the draft step runs)."""
    splits = (1, 2, 4, 8)
    print(f"{'projection':>20}{'T':>5}{'floor us':>10}{'cublas':>9}" + "".join(f"{'split ' + str(s):>9}" for s in splits)
          + f"{'auto':>9}  auto split")  # fmt: skip
    hbm, _ = memory_bytes_per_s(torch.cuda.get_device_name())
    config = skinny._device_config(torch.device("cuda"))
    for (_, name, K, widths), T in itertools.product(SHAPES, rows):
        x = torch.randn(T, K, device="cuda").bfloat16()
        ws = [[torch.randn(n, K, device="cuda").bfloat16() for n in widths] for _ in range(COPIES)]
        floor = sum(widths) * K * 2 / hbm * 1e6
        if name.startswith("gate_up"):
            def run(split):
                return lambda i: skinny.gate_up_act(x, ws[i][0], ws[i][1], True, 0.0, 1.0, split_k=split)
            tiles = -(-widths[0] // config[0])
        else:
            def run(split):
                return lambda i: skinny.linear(x, ws[i], split_k=split)
            tiles = sum(-(-n // config[0]) for n in widths)
        cublas = _graph_us(lambda i: [F.linear(x, w) for w in ws[i]])
        times = [_graph_us(run(s)) for s in splits]
        weight_tiles = 2 if name.startswith("gate_up") else 1
        block_k = skinny._launch_config(config, max(16, 1 << (T - 1).bit_length()), weight_tiles)[1]
        auto = skinny.choose_split(tiles, K, block_k, x.device)
        print(f"{name:>20}{T:>5}{floor:>10.1f}{cublas:>9.1f}" + "".join(f"{t:>9.1f}" for t in times)
              + f"{_graph_us(run(None)):>9.1f}  {auto}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
