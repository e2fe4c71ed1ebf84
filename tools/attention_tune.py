"""Time the draft step's block attention (split launch + merge) on the GPU over launch configs:
key-tile size, warps, pipeline stages and the programs the key splits aim at, per (requests,
context), at the issue-13 preset's heads (32 query / 8 KV heads, D 128, block 16, bf16).

    python tools/attention_tune.py [--requests 1,8,32,64] [--context 1024,8192] [--merge-only]

Each timing is a CUDA graph of 8-16 calls cycling over pools larger than the L2 (so K/V come from
HBM), replayed 20 times; the median replay / calls is one call. Prints the shipped config's time, the
best config's, and the K/V bytes' floor at 4.3 TB/s; then, on the shipped split config, the time
with each count of rows per merge program (`--merge-only`: that alone).
"""

from __future__ import annotations

import argparse
import itertools
import torch

from epdraft.kernels.step import attention, ops
from epdraft.bench.tune import calls_us

HBM = 4.3e12
H, G_KV, B, D = 32, 8, 16, 128


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", default="1,8,32,64")
    p.add_argument("--context", default="1024,8192")
    p.add_argument("--merge-only", action="store_true", help="time the merge's rows per program only")
    args = p.parse_args()
    shipped = (attention._BLOCK_S, attention._NUM_WARPS, attention._NUM_STAGES, attention._TARGET_PROGRAMS)
    configs = list(itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (264, 396, 528)))
    merge_rows = (2, 4, 8, 16, 32)
    print(f"{'N':>4}{'context':>8}{'floor us':>10}{'shipped':>9}{'best':>9}  best (BLOCK_S, warps, stages, programs)"
          f"  us at merge rows {merge_rows} (shipped {ops._MERGE_ROWS})")
    for N, ctx in itertools.product([int(n) for n in args.requests.split(",")], [int(c) for c in args.context.split(",")]):
        S = ctx + B
        kv_bytes = N * G_KV * S * D * 2 * 2
        copies = max(1, -(-200_000_000 // kv_bytes))  # > L2 in all
        pools = [(torch.randn(N, G_KV, S, D, device="cuda").bfloat16(), torch.randn(N, G_KV, S, D, device="cuda").bfloat16())
                 for _ in range(min(copies, 16))]  # fmt: skip
        q = torch.randn(N, H, B, D, device="cuda").bfloat16()
        slots = torch.arange(N, device="cuda", dtype=torch.int32)
        lens = torch.full((N,), S, device="cuda", dtype=torch.int32)
        ref = attention.block_attention_reference(q, *pools[0], slots, lens)

        def timed(cfg) -> float:
            attention._BLOCK_S, attention._NUM_WARPS, attention._NUM_STAGES, attention._TARGET_PROGRAMS = cfg
            try:
                out = attention.block_attention(q, *pools[0], slots, lens)
            except Exception as e:  # a config past the shared memory: not a candidate
                if "out of resource" not in str(e):
                    raise
                return float("inf")
            torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
            calls = max(8, len(pools))
            return calls_us(lambda i: attention.block_attention(q, *pools[i % len(pools)], slots, lens), calls)

        base = timed(shipped)
        best = (base, shipped) if args.merge_only else min(((timed(c), c) for c in configs), key=lambda t: t[0])
        shipped_rows, merged = ops._MERGE_ROWS, []
        for rows in merge_rows:
            ops._MERGE_ROWS = rows
            merged.append(timed(shipped))
        ops._MERGE_ROWS = shipped_rows
        attention._BLOCK_S, attention._NUM_WARPS, attention._NUM_STAGES, attention._TARGET_PROGRAMS = shipped
        print(f"{N:>4}{ctx:>8}{kv_bytes / HBM * 1e6:>10.1f}{base:>9.1f}{best[0]:>9.1f}  {best[1]}  "
              + " / ".join(f"{t:.1f}" for t in merged), flush=True)


if __name__ == "__main__":
    main()
