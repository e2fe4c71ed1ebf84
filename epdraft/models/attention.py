"""DFlash draft attention: block queries over [target-context K/V] ++ [block K/V], non-causal.

Shape legend: N requests (or training sequences), Q query rows (one block at inference), L context
rows, S = L + Q key rows, h query heads, g kv heads, D head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epdraft.kernels.step.attention import block_attention, block_attention_reference, sliding_block_attention
from epdraft.kernels.step.ops import kv_norm_rope_store, qk_norm_rope_store, rms_norm
from epdraft.layers.projection import project, share_storage
from epdraft.layers.step_kernels import StepKernels


class RMSNorm(nn.Module):
    """Qwen-style RMSNorm: normalize in fp32, scale in the input dtype (matches HF Qwen3RMSNorm).
    One launch (`kernels.step.ops.rms_norm`) with the Triton step ops, the torch chain otherwise."""

    def __init__(
        self,
        dim: int,
        eps: float,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        kernels: StepKernels | None = None,
    ):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        kernels = kernels if kernels is not None else StepKernels.for_device(device, dtype)
        self.launch = kernels.step_ops == "triton"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.launch:
            return rms_norm(x, self.weight, self.eps)[0]
        return self.reference(x)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + delta), x + delta): the residual add and the next norm, one launch with the Triton step ops."""
        if self.launch:
            return rms_norm(x, self.weight, self.eps, residual=delta)
        s = x + delta
        return self.reference(s), s

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch chain (CPU, and the oracle of `epdraft.kernels.step.ops.rms_norm`)."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape positions.shape + [head_dim] (fp32), half-split layout as HF `rotate_half`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


_ROPE_TABLES: dict[tuple[int, int, float, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def rope_table(positions: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The first halves of `rope_cos_sin(arange(positions))`, made once per (size, head_dim, theta,
    device) and shared by every layer and draft that asks (a pool's capacity: a few MB)."""
    key = (positions, head_dim, theta, torch.device(device))
    if key not in _ROPE_TABLES:
        cos, sin = rope_cos_sin(torch.arange(positions, device=device), head_dim, theta)
        _ROPE_TABLES[key] = (cos[:, : head_dim // 2].contiguous(), sin[:, : head_dim // 2].contiguous())
    return _ROPE_TABLES[key]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, T, D] rotated by cos/sin [N, T, D]; computed in fp32, returned in x's dtype."""
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (xf * cos + rotated * sin).to(x.dtype)


class DFlashAttention(nn.Module):
    """GQA attention with per-head q/k RMSNorm and RoPE; keys/values = context ++ block.

    Context K/V come from the fused target hidden through this layer's own k_proj/v_proj, k_norm
    and RoPE at the context positions (`context_kv`); callers cache them, since they never change.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        rms_norm_eps: float,
        rope_theta: float,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        kernels: StepKernels | None = None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta = rope_theta
        self.kernels = kernels if kernels is not None else StepKernels.for_device(device, dtype)
        kw = dict(dtype=dtype, device=device)
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, **kw)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False, **kw)
        share_storage(self.q_proj, self.k_proj, self.v_proj)  # one GEMM above the skinny rows
        self.q_norm = RMSNorm(head_dim, rms_norm_eps, kernels=self.kernels, **kw)
        self.k_norm = RMSNorm(head_dim, rms_norm_eps, kernels=self.kernels, **kw)

    def _kv(
        self, x_NTH: torch.Tensor, positions_NT: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        N, T, _ = x_NTH.shape
        k = self.k_norm(self.k_proj(x_NTH).view(N, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x_NTH).view(N, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope if rope is not None else rope_cos_sin(positions_NT, self.head_dim, self.rope_theta)
        return apply_rope(k, cos, sin), v

    def _block_qkv(self, x_NQH: torch.Tensor, positions_NQ: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q [N, h, Q, D] and the block's own k, v [N, g, Q, D] (q, k normed and rotated: one rotary table)."""
        N, Q, _ = x_NQH.shape
        q = self.q_norm(self.q_proj(x_NQH).view(N, Q, self.num_heads, self.head_dim)).transpose(1, 2)
        rope = rope_cos_sin(positions_NQ, self.head_dim, self.rope_theta)
        k_blk, v_blk = self._kv(x_NQH, positions_NQ, rope)
        return apply_rope(q, *rope), k_blk, v_blk

    def rope_table(self, positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [positions, D/2] fp32 of positions 0.. (`rope_cos_sin`'s values: the halves are
        equal), which the fused q/k kernel reads instead of recomputing the table every step."""
        return rope_table(positions, self.head_dim, self.rope_theta, device)

    def context_kv(
        self,
        target_hidden_NLH: torch.Tensor,
        positions_NL: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [N, g, L, D] of the fused target hidden [N, L, H] at positions [N, L] (k: normed + RoPE).
        rope: `rope_cos_sin(positions_NL, ...)` when the caller made it once for every layer."""
        return self._kv(target_hidden_NLH, positions_NL, rope)

    def store_context(
        self, hidden_TH: torch.Tensor, positions_T: torch.Tensor, slots_T: torch.Tensor, pool_k_PgCD: torch.Tensor,
        pool_v_PgCD: torch.Tensor,
    ) -> None:  # fmt: skip
        """`context_kv` of T context rows written straight into a pool at (slots_T, positions_T) with
        the Triton step ops: the K/V projections, then one launch for k's norm and rotary and both
        writes (`kv_norm_rope_store`). No host sync."""
        cos, sin = self.rope_table(pool_k_PgCD.shape[2], hidden_TH.device)
        k_TX, v_TX = project(self.kernels, hidden_TH, self.k_proj, self.v_proj)
        kv_norm_rope_store(k_TX, v_TX, self.k_norm.weight, self.k_norm.eps, cos, sin, positions_T, slots_T,
                           pool_k_PgCD, pool_v_PgCD)  # fmt: skip

    def forward(
        self,
        x_NQH: torch.Tensor,
        positions_NQ: torch.Tensor,
        k_ctx_NgLD: torch.Tensor,
        v_ctx_NgLD: torch.Tensor,
        allowed_NQS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention output [N, Q, H] of the block rows x [N, Q, H] (already input-normed).

        allowed_NQS: bool, True where query q may see key s (keys ordered context then block);
        None = every query sees every key (inference: context is all before the anchor).
        """
        N, Q, _ = x_NQH.shape
        q, k_blk, v_blk = self._block_qkv(x_NQH, positions_NQ)
        k = torch.cat([k_ctx_NgLD, k_blk], dim=2)
        v = torch.cat([v_ctx_NgLD, v_blk], dim=2)
        mask = None if allowed_NQS is None else allowed_NQS.unsqueeze(1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(N, Q, self.num_heads * self.head_dim))

    def forward_pooled(
        self,
        x_NQH: torch.Tensor,
        positions_NQ: torch.Tensor,
        pool_k_PgCD: torch.Tensor,
        pool_v_PgCD: torch.Tensor,
        slots_N: torch.Tensor,
        window: int | None,
        ends_N: torch.Tensor,
    ) -> torch.Tensor:
        """`forward` over a KV pool: the block rows' K/V go to rows `positions` of each request's slot
        (right after its context), then the queries attend to rows [0, position of the last block
        row] of the slot, read in place (with the Triton step ops q/k norm, rotary and the pool write
        are one launch, else the torch chain; the attention is the Triton kernel or the SDPA reference,
        as the rank's `StepKernels` say).
        A sliding-window layer (`window` W) attends as `sliding_block_attention` says instead.

        x_NQH [N, Q, H] (input-normed), positions_NQ [N, Q] = context length + [0, Q), slots_N [N]
        int64 on x's device; ends_N [N] = positions_NQ[:, -1] + 1, which the step makes once for every
        layer. No host sync on CUDA.
        """
        N, Q, _ = x_NQH.shape
        if self.kernels.step_ops == "triton":
            cos, sin = self.rope_table(pool_k_PgCD.shape[2], x_NQH.device)
            q_TX, k_TX, v_TX = project(self.kernels, x_NQH.reshape(N * Q, -1), self.q_proj, self.k_proj, self.v_proj)
            q = qk_norm_rope_store(
                q_TX, k_TX, v_TX, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin, positions_NQ,
                slots_N, pool_k_PgCD, pool_v_PgCD,
            ).transpose(1, 2)  # fmt: skip
        else:
            q, k_blk, v_blk = self._block_qkv(x_NQH, positions_NQ)
            index = (slots_N.unsqueeze(1), slice(None), positions_NQ)
            pool_k_PgCD[index] = k_blk.transpose(1, 2).to(pool_k_PgCD.dtype)
            pool_v_PgCD[index] = v_blk.transpose(1, 2).to(pool_v_PgCD.dtype)
            q = q.to(pool_k_PgCD.dtype)
        if window is not None:
            out = sliding_block_attention(q, pool_k_PgCD, pool_v_PgCD, slots_N, positions_NQ[:, 0], window)
        else:
            attend = block_attention if self.kernels.attention == "triton" else block_attention_reference
            out = attend(q, pool_k_PgCD, pool_v_PgCD, slots_N, ends_N)
        out = out.to(x_NQH.dtype).transpose(1, 2).reshape(N * Q, self.num_heads * self.head_dim)
        return project(self.kernels, out, self.o_proj)[0].view(N, Q, -1)
