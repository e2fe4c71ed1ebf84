"""The Triton programs of `epdraft.kernels.sample.argmax` (imported on first launch); the merge is
also `markov_argmax`'s."""

from __future__ import annotations

import triton
import triton.language as tl

from epdraft.kernels._launch_triton import enter


@triton.jit
def argmax_partial_kernel(x_ptr, val_ptr, idx_ptr, V, NB, stride_n, BLOCK_V: tl.constexpr, PDL: tl.constexpr = False):
    """Vocabulary block vb of row n: the block's largest logit (fp32) and the first token holding it
    at [n, vb]."""
    enter(PDL)
    vb = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    logits = tl.load(x_ptr + n * stride_n + v, mask=v < V, other=float("-inf")).to(tl.float32)
    best = tl.max(logits, axis=0)
    tl.store(val_ptr + n * NB + vb, best)
    tl.store(idx_ptr + n * NB + vb, tl.min(tl.where(logits == best, v, V), axis=0))


@triton.jit
def argmax_merge_kernel(val_ptr, idx_ptr, out_ptr, NB, V, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Row n: the first token of the largest of its NB block maxima (torch.argmax's tie rule)."""
    enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    best = float("-inf")
    for b0 in range(0, NB, BLOCK):
        b = b0 + tl.arange(0, BLOCK)
        best = tl.maximum(best, tl.max(tl.load(val_ptr + n * NB + b, mask=b < NB, other=float("-inf")), axis=0))
    first = V
    for b0 in range(0, NB, BLOCK):
        b = b0 + tl.arange(0, BLOCK)
        ok = b < NB
        vals = tl.load(val_ptr + n * NB + b, mask=ok, other=float("-inf"))
        idxs = tl.load(idx_ptr + n * NB + b, mask=ok, other=V)
        first = tl.minimum(first, tl.min(tl.where(vals == best, idxs, V), axis=0))
    tl.store(out_ptr + n, first.to(tl.int64))
