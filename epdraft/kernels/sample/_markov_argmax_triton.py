"""The Triton program of `epdraft.kernels.sample.markov_argmax` (imported on first launch; its merge
is `_argmax_triton`'s)."""

from __future__ import annotations

import triton
import triton.language as tl

from epdraft.kernels._launch_triton import enter


@triton.jit
def markov_argmax_partial_kernel(
    base_ptr, latent_ptr, w_ptr, val_ptr, idx_ptr,
    N, V, R, NB, stride_b, stride_l, stride_w,
    BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Vocabulary block vb, every row n: logits = base[n] + w[v] . latent[n] in fp32 over the block's
    BLOCK_V tokens; stores the block's max and the first token holding it at [n, vb]. The weight
    block is read once for all rows."""
    enter(PDL)
    vb = tl.program_id(0)
    v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    r = tl.arange(0, BLOCK_R)
    v_ok, r_ok = v < V, r < R
    w = tl.load(w_ptr + v[:, None].to(tl.int64) * stride_w + r[None, :], mask=v_ok[:, None] & r_ok[None, :],
                other=0.0).to(tl.float32)  # fmt: skip
    for n in range(N):
        latent = tl.load(latent_ptr + n * stride_l + r, mask=r_ok, other=0.0)
        base = tl.load(base_ptr + n * stride_b + v, mask=v_ok, other=0.0).to(tl.float32)
        logits = tl.where(v_ok, base + tl.sum(w * latent[None, :], axis=1), float("-inf"))
        best = tl.max(logits, axis=0)
        first = tl.min(tl.where(logits == best, v, V), axis=0)
        tl.store(val_ptr + n * NB + vb, best)
        tl.store(idx_ptr + n * NB + vb, first)
