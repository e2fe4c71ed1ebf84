"""Time the one-launch sampled readout (`kernels.sample.propose`) alone over its tile choices, against
its memory floor: N * k rows of V bf16 logits read three times (max and normalizer, q stored, the
scan; the second and third mostly from L2) and q written once in fp32. CUDA events, median of 50.

    python tools/sample_tune.py [--rows 960] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from epdraft.bench.ceilings import memory_bytes_per_s
from epdraft.kernels import launch
from epdraft.kernels.sample._propose_triton import propose_kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=960, help="N * k draft rows (64 requests x 15 drafts)")
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    R, V = args.rows, args.vocab
    logits = torch.randn(R, V, device="cuda").bfloat16()
    temperature = torch.full((R,), 0.8, device="cuda")
    seed, first = torch.arange(R, device="cuda"), torch.zeros(R, dtype=torch.long, device="cuda")
    tokens = torch.empty(R, dtype=torch.long, device="cuda")
    q = torch.empty(R, V, device="cuda")
    bytes_per_s, ceiling = memory_bytes_per_s(torch.cuda.get_device_name())
    floor_us = 1e6 * (R * V * 2 + R * V * 4) / bytes_per_s  # one logits read + q written
    print(f"{R} rows x V {V}, bf16 logits, {torch.cuda.get_device_name()}; floor (one read + q written, "
          f"{ceiling}) {floor_us:.1f} us")
    print(f"{'BLOCK_V':>8}{'warps':>6}{'us':>9}{'x floor':>9}")
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            def run():
                propose_kernel[(R,)](logits, temperature, seed, first, tokens, q, V, 1, logits.stride(0), STREAM=1,
                                     BLOCK_V=block, num_warps=warps, **launch.kwargs(logits.device))  # fmt: skip
            for _ in range(5):
                run()
            times = []
            for _ in range(50):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            us = statistics.median(times)
            print(f"{block:>8}{warps:>6}{us:>9.1f}{us / floor_us:>9.2f}")


if __name__ == "__main__":
    main()
