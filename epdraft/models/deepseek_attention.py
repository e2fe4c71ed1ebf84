"""DeepSeek DSpark draft attention (V4 and V4.1, issue 31): one shared K=V head, partial interleaved
RoPE, per-head sinks, grouped low-rank output, block queries over a block-anchored context window.

V4.1 (`q_norm=False`) follows the architecture description (reference draft_models.md 6b), not yet
checked against a released V4.1 export.

Served by `DeepseekDSparkDraft` (deepseek_dspark.py). The torch code here is the CPU path and the
oracle of the step's Triton launches (`kernels.step.sink_attention`, `kernels.step.ops.rms_norm`,
`kernels.step.kv_finish`).

Shape legend: N requests, B block rows (the queries), L context positions, S context rows handed to one
block (a window of at most `window` rows, in any order), h query heads, D head_dim (the one K=V head:
512 on DeepSeek), R rope_head_dim (64: the trailing R channels of every head and of the K=V row),
G o_groups.
"""

from __future__ import annotations

import torch
from torch import nn

from epdraft.errors import ConfigError
from epdraft.kernels.step import sink_attention as sink_kernel
from epdraft.kernels.step.kv_finish import kv_finish, kv_finish_store
from epdraft.kernels.step.ops import rms_norm

# DeepSeek's per-stage tensor names (`mtp.{i}.attn.<name>`) -> this module's parameter names (the same
# names as transformers' `DeepseekV4Attention`, so its state dict loads as is). `q_norm` is DeepSeek's
# norm of the low-rank q (our `q_a_norm`), not V4's parameter-free per-head norm (which has no tensor).
DEEPSEEK_ATTENTION_NAMES: dict[str, str] = {
    "wq_a.weight": "q_a_proj.weight",
    "q_norm.weight": "q_a_norm.weight",
    "wq_b.weight": "q_b_proj.weight",
    "wkv.weight": "kv_proj.weight",
    "kv_norm.weight": "kv_norm.weight",
    "wo_a.weight": "o_a_proj.weight",
    "wo_b.weight": "o_b_proj.weight",
    "attn_sink": "sinks",
}


def interleaved_rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape positions.shape + [rope_dim / 2] (fp32): one angle per channel pair,
    position * theta^(-2i / rope_dim) for pair i (plain RoPE, no scaling)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, device=positions.device, dtype=torch.float32) / rope_dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    return freqs.cos(), freqs.sin()


def apply_interleaved_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False
) -> torch.Tensor:
    """x [..., D] with its trailing R = 2 * cos.shape[-1] channels rotated as pairs (0,1), (2,3), ...
    (DeepSeek's interleaved layout, not rotate-half); the leading D - R channels pass through.

    cos, sin [..., R / 2] broadcast against x's leading dims (fp32). `inverse` rotates by the conjugate
    (the angle negated), which undoes a rotation at the same position. Computed in fp32, returned in
    x's dtype.
    """
    rope_dim = 2 * cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    if inverse:
        sin = -sin
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


def fp8_ue8m0_roundtrip(x: torch.Tensor, group: int = 64) -> torch.Tensor:
    """x [..., C] rounded through FP8 e4m3 and back, with a power-of-two scale per `group` channels
    (the whole row when C is not a multiple): what DeepSeek's serving `act_quant(..., "ue8m0")`
    stores of the K=V row's non-rope channels, and what SpecForge trains DSpark V4 drafts against
    (`kv_fake_quant`). Scale = 2^ceil(log2(amax / 448)), amax floored at 1e-4; x's dtype back."""
    group = group if x.shape[-1] % group == 0 else x.shape[-1]
    g = x.float().unflatten(-1, (-1, group))
    amax = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q = (g / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale
    return q.flatten(-2).to(x.dtype)


def finish_kv(kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, fake_quant: bool) -> torch.Tensor:
    """The K=V row [..., D] (kv's dtype) from its `kv_norm` output kv [..., D]: with `fake_quant` its
    non-rope channels (the leading D - R, R = 2 * cos.shape[-1]) through `fp8_ue8m0_roundtrip`, then
    `apply_interleaved_rope` at cos, sin [..., R / 2] (fp32). The torch chain of
    `kernels.step.kv_finish` (the CPU path and that launch's oracle)."""
    R = 2 * cos.shape[-1]
    if fake_quant and R < kv.shape[-1]:  # the non-rope channels as DeepSeek's serving stores them (FP8, ue8m0)
        kv = torch.cat([fp8_ue8m0_roundtrip(kv[..., :-R]), kv[..., -R:]], dim=-1)
    return apply_interleaved_rope(kv, cos, sin)


def context_window(
    kv_NLD: torch.Tensor, context_lens_N: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block-anchored window of each request's context: its last min(window, length) rows.

    kv_NLD [N, L, D]: request n's context rows are 0 .. context_lens_N[n] - 1 (right padding beyond);
    context_lens_N [N] int64 on kv's device. Returns (kv_NSD [N, S, D], valid_NS [N, S] bool) with
    S = min(window, L): row j of request n is context row length - S + j, valid where that row exists.
    No host sync.
    """
    N, L, D = kv_NLD.shape
    S = min(window, L)
    rows_NS = context_lens_N.unsqueeze(1) - S + torch.arange(S, device=kv_NLD.device)
    valid_NS = rows_NS >= 0
    kv_NSD = torch.gather(kv_NLD, 1, rows_NS.clamp(min=0).unsqueeze(-1).expand(N, S, D))
    return kv_NSD, valid_NS


def sink_attention(
    q_NBhD: torch.Tensor, kv_NSD: torch.Tensor, valid_NS: torch.Tensor, sinks_h: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention of every query head over one shared K=V head, with a per-head sink.

    q_NBhD [N, B, h, D]; kv_NSD [N, S, D] read as both keys and values; valid_NS [N, S] bool (False:
    the row is left out; every query of a request sees the same rows); sinks_h [h]. The weights are
    softmax over [scale * q.k for the valid rows, sink]: exp(sink - max) joins the denominator only
    and the sink is not scaled. Each query needs one valid row (a block always sees its own rows).
    Scores, softmax and the weighted sum in fp32 (the operands are upcast); returns [N, B, h, D] fp32.
    """
    N, B, h, _ = q_NBhD.shape
    kv_f = kv_NSD.float()
    scores_NBhS = torch.einsum("nbhd,nsd->nbhs", q_NBhD.float(), kv_f) * scale
    scores_NBhS = scores_NBhS.masked_fill(~valid_NS[:, None, None, :], float("-inf"))
    sinks = sinks_h.float().view(1, 1, h, 1).expand(N, B, h, 1)
    probs = torch.softmax(torch.cat([scores_NBhS, sinks], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("nbhs,nsd->nbhd", probs, kv_f)


class DeepseekRMSNorm(nn.Module):
    """DeepSeek's RMSNorm: normalize and scale in fp32, cast the product to the input dtype
    (as transformers' `DeepseekV4RMSNorm`; Qwen's `attention.RMSNorm` casts before scaling).
    `fused`: one launch (`kernels.step.ops.rms_norm`, the step ops' Triton family), else the torch chain."""

    def __init__(
        self,
        dim: int,
        eps: float,
        *,
        fused: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return rms_norm(x, self.weight, self.eps, round_first=False)[0]
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch chain (CPU, and the oracle of the fused launch)."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


class DeepseekDSparkAttention(nn.Module):
    """DeepSeek-V4 / V4.1 DSpark draft attention over [context window rows, the block's own rows].

    q = q_b_proj(q_a_norm(q_a_proj(x))) per head, then (V4 only, `q_norm=True`) a parameter-free
    per-head RMS norm, then interleaved RoPE on its trailing R channels; kv = kv_norm(kv_proj(x)) with
    the same RoPE: the one D-wide head every query head reads as key and value. Every block query sees
    the valid context rows and the whole block (bidirectional), scale D^-0.5, a per-head sink in the
    denominator. Since V = K carries the keys' rotation, the output's rope slice is rotated back at the
    query position; then `o_a_proj` block-diagonal over G groups of h / G heads (each -> o_lora_rank)
    and `o_b_proj`.

    Parameters, with DeepSeek's names (`mtp.{i}.attn.*`, see `DEEPSEEK_ATTENTION_NAMES`) and shapes:
        q_a_proj.weight  <- wq_a     [q_lora_rank, hidden]
        q_a_norm.weight  <- q_norm   [q_lora_rank]
        q_b_proj.weight  <- wq_b     [h * D, q_lora_rank]
        kv_proj.weight   <- wkv      [D, hidden]
        kv_norm.weight   <- kv_norm  [D]
        o_a_proj.weight  <- wo_a     [G * o_lora_rank, h * D / G] (group g: rows g*o_lora_rank ...)
        o_b_proj.weight  <- wo_b     [hidden, G * o_lora_rank]
        sinks            <- attn_sink [h] (fp32 in the checkpoint; always applied in fp32)
    They equal transformers' `DeepseekV4Attention` names (its sliding layers: no compressor).
    `kv_fake_quant`: every K=V row's non-rope channels go through `fp8_ue8m0_roundtrip` (SpecForge V4
    exports are trained so). `fused_norms`: the two norms as one launch each (`DeepseekRMSNorm`);
    `fused_attention`: the attention proper (scores, sinks, softmax, values, the inverse rotation) as
    one launch (`kernels.step.sink_attention`, where its shapes fit), else `sink_attention` in torch;
    `fused_kv`: the K=V row's finish (the fake quant and the rotary, `finish_kv`) as one launch
    (`kernels.step.kv_finish`), which a commit also uses to write the rows into the ring
    (`store_context_kv`).
    DeepSeek's FP8 linears must be dequantized before loading (not handled here).

    Raises ConfigError for shapes that cannot be laid out (h not divisible by G, R odd or > D).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int,
        head_dim: int,
        rope_head_dim: int,
        o_groups: int,
        o_lora_rank: int,
        *,
        rope_theta: float,
        rms_norm_eps: float,
        q_norm: bool,
        kv_fake_quant: bool = False,
        fused_norms: bool = False,
        fused_attention: bool = False,
        fused_kv: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if num_heads % o_groups:
            raise ConfigError(
                f"DeepseekDSparkAttention: num_heads {num_heads} must be a multiple of o_groups {o_groups}"
            )
        if rope_head_dim % 2 or not 0 < rope_head_dim <= head_dim:
            raise ConfigError(
                f"DeepseekDSparkAttention: rope_head_dim {rope_head_dim} must be even and in (0, head_dim {head_dim}]"
            )
        self.num_heads, self.head_dim, self.rope_head_dim = num_heads, head_dim, rope_head_dim
        self.o_groups, self.o_lora_rank = o_groups, o_lora_rank
        self.rope_theta, self.eps, self.q_norm = rope_theta, rms_norm_eps, q_norm
        self.kv_fake_quant, self.fused_kv = kv_fake_quant, fused_kv
        self.fused_attention = fused_attention and sink_kernel.fits(head_dim, rope_head_dim)
        self.scale = head_dim**-0.5
        kw = dict(dtype=dtype, device=device)
        self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False, **kw)
        self.q_a_norm = DeepseekRMSNorm(q_lora_rank, rms_norm_eps, fused=fused_norms, **kw)
        self.q_b_proj = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False, **kw)
        self.kv_proj = nn.Linear(hidden_size, head_dim, bias=False, **kw)
        self.kv_norm = DeepseekRMSNorm(head_dim, rms_norm_eps, fused=fused_norms, **kw)
        self.o_a_proj = nn.Linear(num_heads * head_dim // o_groups, o_groups * o_lora_rank, bias=False, **kw)
        self.o_b_proj = nn.Linear(o_groups * o_lora_rank, hidden_size, bias=False, **kw)
        self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32, device=device))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin positions.shape + [R / 2] fp32 (`interleaved_rope_cos_sin` at this layer's theta)."""
        return interleaved_rope_cos_sin(positions, self.rope_head_dim, self.rope_theta)

    def _kv(self, x_NTH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        kv = self.kv_norm(self.kv_proj(x_NTH))
        if not self.fused_kv:
            return finish_kv(kv, cos, sin, fake_quant=self.kv_fake_quant)
        D, half = self.head_dim, self.rope_head_dim // 2
        rows = kv.shape[:-1]
        cos_TR, sin_TR = (torch.broadcast_to(t, (*rows, half)).reshape(-1, half) for t in (cos, sin))
        return kv_finish(kv.reshape(-1, D), cos_TR, sin_TR, fake_quant=self.kv_fake_quant).view(*rows, D)

    def store_context_kv(
        self,
        hidden_TH: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        slot_T: torch.Tensor,
        position_T: torch.Tensor,
        ring_PWD: torch.Tensor,
    ) -> None:
        """`context_kv` of T context rows hidden_TH [T, H] written straight into a ring [P, W, D]
        (`WindowKVPool.kv[layer]`) at ring[slot_T, position_T % W], cast to the ring's dtype, as
        `WindowKVPool.store` writes them: one launch after the projection and the norm
        (`kernels.step.kv_finish.kv_finish_store`). rope: cos, sin [T, R / 2] fp32 of position_T
        (`self.rope`). Only with `fused_kv` (a commit otherwise stores `context_kv`'s rows)."""
        if not self.fused_kv:
            raise ConfigError("store_context_kv: this attention was built without fused_kv (the torch path "
                              "stores context_kv's rows with WindowKVPool.store)")  # fmt: skip
        kv_finish_store(self.kv_norm(self.kv_proj(hidden_TH)), *rope, slot_T, position_T, ring_PWD,
                        fake_quant=self.kv_fake_quant)  # fmt: skip

    def context_kv(
        self, hidden_NLH: torch.Tensor, positions_NL: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The shared K=V row [N, L, D] (x's dtype) of each context position: kv_norm(kv_proj(x)),
        its rope slice rotated at its position. A KV pool stores it once per position (per layer).
        rope: `self.rope(positions_NL)` when the caller made it once for every layer."""
        return self._kv(hidden_NLH, *(rope if rope is not None else self.rope(positions_NL)))

    def forward(
        self, x_NBH: torch.Tensor, positions_NB: torch.Tensor, kv_ctx_NSD: torch.Tensor, ctx_valid_NS: torch.Tensor
    ) -> torch.Tensor:
        """Attention output [N, B, H] (x's dtype) of the block rows x_NBH [N, B, H] (already input-normed).

        positions_NB [N, B]: the rope positions of the block rows. kv_ctx_NSD [N, S, D]: the block's
        context window, `context_kv` rows (e.g. `context_window`'s, or a pool's ring of `window` slots
        as stored: the row order does not matter, each row carries its own rotation); S may be 0.
        ctx_valid_NS [N, S] bool: False leaves a row out (slots not yet written, positions outside the
        window). Scores and softmax in fp32 (`sink_attention`). N may be 0.
        """
        N, B, _ = x_NBH.shape
        h, D = self.num_heads, self.head_dim
        cos, sin = self.rope(positions_NB)
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x_NBH))).view(N, B, h, D)
        if self.q_norm:  # V4 only: parameter-free per-head RMS norm
            qf = q.float()
            q = (qf * torch.rsqrt(qf.pow(2).mean(-1, keepdim=True) + self.eps)).to(q.dtype)
        q = apply_interleaved_rope(q, cos.unsqueeze(2), sin.unsqueeze(2))
        kv_blk = self._kv(x_NBH, cos, sin)
        if self.fused_attention:
            o_NBhD = sink_kernel.sink_block_attention(q, kv_ctx_NSD, ctx_valid_NS, kv_blk, self.sinks, cos, sin,
                                                      self.scale)  # fmt: skip
        else:
            kv_NSD = torch.cat([kv_ctx_NSD.to(kv_blk.dtype), kv_blk], dim=1)
            block_valid = torch.ones(N, B, dtype=torch.bool, device=x_NBH.device)
            valid_NS = torch.cat([ctx_valid_NS.to(torch.bool), block_valid], dim=1)
            o_NBhD = sink_attention(q, kv_NSD, valid_NS, self.sinks, self.scale)
            # K = V: the output's rope slice is a mix of rotated key rows; undo the rotation at the query's
            # position, so each row's contribution depends on the relative distance only.
            o_NBhD = apply_interleaved_rope(o_NBhD, cos.unsqueeze(2), sin.unsqueeze(2), inverse=True).to(x_NBH.dtype)
        G = self.o_groups
        w_a = self.o_a_proj.weight.view(G, self.o_lora_rank, h * D // G)
        o_NBGr = torch.einsum("nbgi,gri->nbgr", o_NBhD.reshape(N, B, G, h * D // G), w_a)
        return self.o_b_proj(o_NBGr.flatten(2))
