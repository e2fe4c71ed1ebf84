"""A DeepSeek DSpark draft's block attention as one Triton launch per layer (CUDA): every query head
over one shared K=V head (the block-anchored context window and the block itself), a per-head sink
in the softmax denominator, and the output's rope slice rotated back at the query's position.

Why: the torch chain (`epdraft.models.deepseek_attention`: fp32 copies of q and the rows, two
einsums, the mask, the sink's cat, softmax, the inverse rotation's slices and cats) is ~25 kernels
a layer. This equals `sink_attention` followed by `apply_interleaved_rope(..., inverse=True)` and
the cast to q's dtype, with the probabilities rounded to the rows' dtype before the value product
(as flash attention does): within one bf16 rounding in bf16, fp32 rounding order in fp32 (its dots
in full fp32, not TF32; tests/gpu/test_deepseek_kernels.py).
The grid depends on shapes only and nothing is read on the host: a CUDA graph can hold it.
"""

from __future__ import annotations

import torch

from epdraft.errors import ConfigError
from epdraft.kernels import launch
from epdraft.kernels.launch import next_pow2

_BLOCK_Q = 32  # query rows (b * h + head) per program: B * h = 320 on V4.1-Flash, 10 programs a request
_BLOCK_D = 64


def fits(head_dim: int, rope_dim: int) -> bool:
    """Whether the launch takes this head: D and R multiples of its 64-channel chunks (a chunk is
    then wholly inside or outside the rope slice)."""
    return head_dim % _BLOCK_D == 0 and rope_dim % _BLOCK_D == 0 and 0 < rope_dim <= head_dim


def sink_block_attention(
    q_NBhD: torch.Tensor,
    ctx_NSD: torch.Tensor,
    ctx_valid_NS: torch.Tensor,
    blk_NBD: torch.Tensor,
    sinks_h: torch.Tensor,
    cos_NBr: torch.Tensor,
    sin_NBr: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """[N, B, h, D] in q's dtype. q_NBhD: the rotated queries; ctx_NSD: the window's K=V rows
    (rotated, any order; S may be 0), ctx_valid_NS: bool, False leaves a row out; blk_NBD: the
    block's own K=V rows (rotated, all valid); sinks_h [h]; cos_NBr / sin_NBr [N, B, R / 2] fp32:
    the query positions' angles (R = the rope slice, the trailing channels)."""
    launch.refuse_autograd("sink_block_attention", q_NBhD, ctx_NSD, blk_NBD, sinks_h)
    from epdraft.kernels.step._sink_attention_triton import sink_attention_kernel

    N, B, h, D = q_NBhD.shape
    S, R = ctx_NSD.shape[1], 2 * cos_NBr.shape[-1]
    if not fits(D, R):
        raise ConfigError(f"sink_block_attention: head_dim {D} and rope dim {R} must be multiples of {_BLOCK_D}")
    q = q_NBhD.contiguous()
    blk = blk_NBD.to(q.dtype).contiguous()
    ctx = ctx_NSD.to(q.dtype)
    if ctx.stride(-1) != 1:
        ctx = ctx.contiguous()
    valid = ctx_valid_NS.to(torch.uint8)
    cos, sin = cos_NBr.float().contiguous(), sin_NBr.float().contiguous()
    out = torch.empty_like(q)
    if N:
        sink_attention_kernel[(N, -(-B * h // _BLOCK_Q))](
            q, ctx, valid, blk, sinks_h, cos, sin, out, S, scale,
            q.stride(0), ctx.stride(0), ctx.stride(1), valid.stride(0), blk.stride(0), cos.stride(0), out.stride(0),
            B=B, NUM_HEADS=h, D=D, R=R, BLOCK_Q=_BLOCK_Q, BLOCK_S=max(16, next_pow2(S)),
            BLOCK_B=max(16, next_pow2(B)), BLOCK_D=_BLOCK_D, num_warps=4,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **launch.kwargs(q.device),
        )  # fmt: skip
    return out
