"""A Markov head's greedy draft in two launches (CUDA): argmax over the vocabulary of base logits +
markov_w2 . latent, without the [N, V] logits or an fp32 copy of markov_w2.

Why: the torch chain (`epdraft.models.dspark.MarkovHead.decode`: markov_w2 copied to fp32 every
step, an fp32 GEMV per drafted position, the logits' fp32 sum and torch's argmax over 129280
tokens) cost ~470 µs of the V4.1-Flash draft step at one request on an H100, its weights' floor
~90 (docs/performance.md). Here each position reads markov_w2 once in its stored dtype, all rows
against one weight block per program, then one program per row merges the block maxima. Equal to
`(base.float() + latent @ w2.float().T).argmax(-1)` but where two logits tie to within the fp32
rounding of their sums' order (tests/gpu/test_deepseek_kernels.py). Shape-only grids, no host
reads: a CUDA graph holds it.
"""

from __future__ import annotations

import torch

from epdraft.kernels import launch
from epdraft.kernels.launch import next_pow2

BLOCK_V = 32  # tokens per program: one 32 x 256 weight block in registers, ~4000 programs at V = 129280
# Rows up to which a Markov head takes this launch: its fp32 FMAs run all rows against each weight
# block, so past a few rows cuBLAS's GEMM on an fp32 copy wins. V4.1-Flash's step on an H100
# (docs/performance.md): 2.555 -> 2.237 ms at 1 request, 5.152 -> 4.890 at 8,
# but 8.588 -> 9.098 at 32 and 10.738 -> 12.116 at 64.
MAX_ROWS = 16
_MERGE_BLOCK = 1024


def markov_argmax(base_NV: torch.Tensor, latent_Nr: torch.Tensor, w2_Vr: torch.Tensor) -> torch.Tensor:
    """[N] int64: argmax over V of base_NV (any float dtype, unit stride in V) + latent_Nr (fp32) .
    w2_Vr (the head's weight, any float dtype) per row, the first token on a tie."""
    launch.refuse_autograd("markov_argmax", base_NV, latent_Nr, w2_Vr)
    from epdraft.kernels.sample._argmax_triton import argmax_merge_kernel
    from epdraft.kernels.sample._markov_argmax_triton import markov_argmax_partial_kernel

    N, V = base_NV.shape
    R = w2_Vr.shape[1]
    out = torch.empty(N, dtype=torch.long, device=base_NV.device)
    if N == 0:
        return out
    base = base_NV if base_NV.stride(-1) == 1 else base_NV.contiguous()
    latent = latent_Nr.float().contiguous()
    w2 = w2_Vr if w2_Vr.stride(-1) == 1 else w2_Vr.contiguous()
    blocks = -(-V // BLOCK_V)
    vals = torch.empty(N, blocks, dtype=torch.float32, device=base.device)
    idxs = torch.empty(N, blocks, dtype=torch.int32, device=base.device)
    kw = launch.kwargs(base.device)
    markov_argmax_partial_kernel[(blocks,)](
        base, latent, w2, vals, idxs, N, V, R, blocks, base.stride(0), latent.stride(0), w2.stride(0),
        BLOCK_V=BLOCK_V, BLOCK_R=next_pow2(R), num_warps=4, **kw,
    )  # fmt: skip
    argmax_merge_kernel[(N,)](vals, idxs, out, blocks, V, BLOCK=_MERGE_BLOCK, num_warps=4, **kw)
    return out
