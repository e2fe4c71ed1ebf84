"""The greedy readout's argmax over the vocabulary in two launches (CUDA).

Why: torch's argmax over the lm_head's [rows, V] logits reduces each row in one block, so a step's
15 rows x 32000 tokens kept 15 blocks busy for 9.1 µs of an H100 to read under 1 MB (3.0 µs here;
5.7 against 12.7 at 120 rows, 23.6 against 43.4 at 960: docs/performance.md, sixteenth session).
Here one program per (row, vocabulary block) finds its block's maximum and first
token, then one program per row merges them (`argmax_merge_kernel`, shared with `markov_argmax`).
torch.argmax's result, ties to the first token included. Shape-only grids, no host reads: a CUDA
graph holds it.
"""

from __future__ import annotations

import torch

from epdraft.kernels import launch

BLOCK_V = 2048  # tokens per program: 16 blocks at V = 32000, 64 at 129280
_MERGE_BLOCK = 128


def argmax_rows(logits_NV: torch.Tensor) -> torch.Tensor:
    """[N] int64: the first token of each row's largest logit (logits_NV [N, V], any float dtype)."""
    from epdraft.kernels.sample._argmax_triton import argmax_merge_kernel, argmax_partial_kernel

    N, V = logits_NV.shape
    out = torch.empty(N, dtype=torch.long, device=logits_NV.device)
    if N == 0:
        return out
    x = logits_NV if logits_NV.stride(-1) == 1 else logits_NV.contiguous()
    blocks = -(-V // BLOCK_V)
    vals = torch.empty(N, blocks, dtype=torch.float32, device=x.device)
    idxs = torch.empty(N, blocks, dtype=torch.int32, device=x.device)
    kw = launch.kwargs(x.device)
    argmax_partial_kernel[(blocks, N)](x, vals, idxs, V, blocks, x.stride(0), BLOCK_V=BLOCK_V, num_warps=4, **kw)
    argmax_merge_kernel[(N,)](vals, idxs, out, blocks, V, BLOCK=_MERGE_BLOCK, num_warps=1, **kw)
    return out
