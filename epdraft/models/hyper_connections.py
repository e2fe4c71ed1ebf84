"""mHC residual (manifold-constrained hyper-connections) of DeepSeek-V4 / V4.1 DSpark draft layers.

The residual is `hc_mult` streams instead of one. Around each sublayer (attention, FFN), mixes
computed in fp32 from the streams collapse them into the sublayer's input (`pre`), write its output
back to every stream (`post`) and mix the residual streams among themselves (`comb`, made doubly
stochastic by Sinkhorn so the residual stays non-expansive however many layers it crosses):

    pre, post, comb = mixes(streams)
    streams' = post * sublayer(sum_j pre_j streams_j) + comb^T streams   (new_k = sum_j comb[j, k] old_j)

Two variants, chosen at construction (`single_pass`):

- V4 (transformers' `DeepseekV4HyperConnection`): each sublayer collapses its input streams with the
  pre mix computed from those same streams. The readout is `HyperHead` (`DeepseekV4HyperHead`).
- V4.1 single pass (DeepSeek's V4.1 inference code, reference draft_models.md 6b): the pre mix
  computed at one sublayer collapses the *next* sublayer's streams (layer l's FFN feeds layer l+1's
  attention), so the streams are read once per sublayer: a fused kernel can write the new streams and
  the next sublayer's input together. The first sublayer reads stream 0 (every stream is still a copy
  of the block input); the readout collapses with the last pre mix (`single_pass_readout`).
  The lagged mix travels inside `Streams`, so both variants are called alike. Built from that
  description, not yet checked against a released V4.1 export.

Shape legend: N rows (requests x block positions, flattened; may be 0: an idle rank still runs its
layers), c = hc_mult streams, H hidden size, X = c * H flattened streams, M = (2 + c) * c mixes
(pre c, post c, comb c * c, in that order).

Math runs in fp32 whatever the streams' dtype; the sublayer input and the new streams come back in
the streams' dtype (DeepSeek's hc_pre / hc_post cast the same way; transformers' decoder layer does the
post/comb mix in the model dtype, so in bf16 it differs from this by rounding only).

Checkpoint names (all fp32), DeepSeek's stage i -> this module:
    mtp.{i}.hc_attn_fn [M, X] | hc_attn_base [M] | hc_attn_scale [3]  ->  <attn HyperConnection>.fn | .base | .scale
    mtp.{i}.hc_ffn_fn | hc_ffn_base | hc_ffn_scale                     ->  <ffn HyperConnection>.fn | .base | .scale
    mtp.{i}.hc_head_fn [c, X] | hc_head_base [c] | hc_head_scale [1]   ->  HyperHead.fn | .base | .scale (V4)
transformers: `layers.{l}.attn_hc.{fn,base,scale}` / `ffn_hc.*` load unchanged; `hc_head.hc_{fn,base,scale}`
-> HyperHead.{fn,base,scale}.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from epdraft.errors import ConfigError
from epdraft.kernels.step import hc


class HCMixes(NamedTuple):
    """One sublayer's mixes, fp32: pre_Nc [N, c] (collapse), post_Nc [N, c] (write-back),
    comb_Ncc [N, c, c] (residual mix, doubly stochastic; new stream k = sum_j comb[j, k] old j)."""

    pre_Nc: torch.Tensor
    post_Nc: torch.Tensor
    comb_Ncc: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Streams:
    """The mHC residual between sublayers.

    x_NcH [N, c, H] in the model dtype. pre_Nc [N, c] fp32: on V4.1 the lagged pre mix the next
    sublayer collapses with (one-hot on stream 0 at the block input); None on V4, which computes it
    from the streams at each sublayer.
    """

    x_NcH: torch.Tensor
    pre_Nc: torch.Tensor | None = None


def sinkhorn(logits_Ncc: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Doubly stochastic [..., c, c] fp32 from logits: a row softmax plus eps, a column normalization,
    then (iters - 1) row + column normalizations, each denominator + eps (DeepSeek's order: the eps
    keeps a row of zeros finite and is why rows and columns sum to 1 only to ~1e-6)."""
    comb = torch.softmax(logits_Ncc.float(), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def normalized_projection(x_NcH: torch.Tensor, fn_KX: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """[N, K] fp32: the flattened streams projected by fn_KX [K, X], times their unweighted
    rsqrt(mean square + norm_eps). Scaling the K outputs equals normalizing the X inputs first
    (transformers' order) and costs K multiplies instead of X."""
    flat_NX = x_NcH.flatten(1).float()
    rsqrt_N1 = torch.rsqrt(flat_NX.square().mean(dim=-1, keepdim=True) + norm_eps)
    return F.linear(flat_NX, fn_KX.float()) * rsqrt_N1


def split_mixes(
    raw_NM: torch.Tensor,
    scale_3: torch.Tensor,
    base_M: torch.Tensor,
    *,
    hc_mult: int,
    sinkhorn_iters: int,
    hc_eps: float,
) -> HCMixes:
    """HCMixes from the normalized projection raw_NM [N, M] fp32: pre = sigmoid + eps (never 0, so
    every stream is read), post = 2 sigmoid (a stream may take up to twice the output), comb by Sinkhorn."""
    c = hc_mult
    scale_3, base_M = scale_3.float(), base_M.float()
    pre_w, post_w, comb_w = raw_NM.split([c, c, c * c], dim=-1)
    pre_b, post_b, comb_b = base_M.split([c, c, c * c])
    pre_Nc = torch.sigmoid(pre_w * scale_3[0] + pre_b) + hc_eps
    post_Nc = 2.0 * torch.sigmoid(post_w * scale_3[1] + post_b)
    comb_logits = (comb_w * scale_3[2] + comb_b).unflatten(-1, (c, c))
    return HCMixes(pre_Nc, post_Nc, sinkhorn(comb_logits, sinkhorn_iters, hc_eps))


def collapse(x_NcH: torch.Tensor, pre_Nc: torch.Tensor) -> torch.Tensor:
    """[N, H] in x's dtype: sum_j pre_j x_j, accumulated in fp32."""
    return (pre_Nc.float().unsqueeze(-1) * x_NcH.float()).sum(dim=1).to(x_NcH.dtype)


def write_back(y_NH: torch.Tensor, x_NcH: torch.Tensor, post_Nc: torch.Tensor, comb_Ncc: torch.Tensor) -> torch.Tensor:
    """New streams [N, c, H] in x's dtype: post_k y + sum_j comb[j, k] x_j, in fp32. comb is used
    transposed (Sinkhorn's result is not symmetric, so the direction matters)."""
    mixed_NcH = torch.matmul(comb_Ncc.float().transpose(-1, -2), x_NcH.float())
    return (post_Nc.float().unsqueeze(-1) * y_NH.float().unsqueeze(1) + mixed_NcH).to(x_NcH.dtype)


def enter_streams(x_NH: torch.Tensor, hc_mult: int, *, single_pass: bool) -> Streams:
    """The block input [N, H] copied to hc_mult streams; on V4.1 with the one-hot pre that makes the
    first sublayer read stream 0 (exactly x, since every stream is a copy)."""
    x_NcH = x_NH.unsqueeze(1).expand(-1, hc_mult, -1).contiguous()
    if not single_pass:
        return Streams(x_NcH)
    pre_Nc = torch.zeros(x_NH.shape[0], hc_mult, dtype=torch.float32, device=x_NH.device)
    pre_Nc[:, 0] = 1.0
    return Streams(x_NcH, pre_Nc)


def single_pass_readout(streams: Streams) -> torch.Tensor:
    """V4.1's readout [N, H] before the final norm: the streams collapsed with the last lagged pre mix."""
    if streams.pre_Nc is None:
        raise ConfigError("single_pass_readout needs V4.1 streams (a lagged pre mix); V4 streams are read by HyperHead")
    return collapse(streams.x_NcH, streams.pre_Nc)


def _check_hc(hidden_size: int, hc_mult: int, sinkhorn_iters: int | None = None) -> None:
    if hidden_size < 1 or hc_mult < 1:
        raise ConfigError(f"mHC needs hidden_size >= 1 and hc_mult >= 1, got {hidden_size} and {hc_mult}")
    if sinkhorn_iters is not None and sinkhorn_iters < 1:
        raise ConfigError(f"hc_sinkhorn_iters = {sinkhorn_iters} must be >= 1")


class HyperConnection(nn.Module):
    """One sublayer's mHC mixing: fn [M, X], base [M], scale [3] (pre, post, comb), fp32 like the
    checkpoint whatever the model dtype (loads `hc_attn_*` / `hc_ffn_*` by name: module docstring).

    `single_pass` picks V4.1's lagged pre mix over V4's own, `fused` the Triton launches of
    `kernels.step.hc` over the torch functions above (both decided once, here; the caller passes
    `fused` from its resolved StepKernels). `forward` wraps a sublayer; `read_input` / `write_output`
    split it for a caller that runs the sublayer itself.
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        hc_mult: int,
        sinkhorn_iters: int,
        hc_eps: float,
        norm_eps: float,
        single_pass: bool,
        fused: bool = False,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        _check_hc(hidden_size, hc_mult, sinkhorn_iters)
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        self.single_pass = single_pass
        self._fused = fused and hc.fits(hc_mult)  # a shape the launches do not take keeps the torch path
        self._collapse = hc.hc_collapse if self._fused else collapse
        self._write_back = hc.hc_write_back if self._fused else write_back
        num_mixes = (2 + hc_mult) * hc_mult
        kw = dict(dtype=torch.float32, device=device)
        self.fn = nn.Parameter(torch.empty(num_mixes, hc_mult * hidden_size, **kw))
        self.base = nn.Parameter(torch.zeros(num_mixes, **kw))
        self.scale = nn.Parameter(torch.ones(3, **kw))
        nn.init.normal_(self.fn, std=0.02)

    def mixes(self, x_NcH: torch.Tensor) -> HCMixes:
        """HCMixes (fp32) of streams x_NcH [N, c, H] in any dtype."""
        if self._fused:
            return HCMixes(*hc.hc_mixes(x_NcH, self.fn, self.scale, self.base, sinkhorn_iters=self.sinkhorn_iters,
                                        hc_eps=self.hc_eps, norm_eps=self.norm_eps))  # fmt: skip
        raw_NM = normalized_projection(x_NcH, self.fn, self.norm_eps)
        return split_mixes(
            raw_NM, self.scale, self.base, hc_mult=self.hc_mult, sinkhorn_iters=self.sinkhorn_iters, hc_eps=self.hc_eps
        )

    def read_input(self, streams: Streams) -> tuple[torch.Tensor, HCMixes]:
        """(the sublayer's input [N, H] in the streams' dtype, this sublayer's mixes). V4 collapses with
        the pre mix of these streams, V4.1 with the one carried in `streams`."""
        m = self.mixes(streams.x_NcH)
        pre_Nc = streams.pre_Nc if self.single_pass else m.pre_Nc
        if pre_Nc is None:
            raise ConfigError("a single-pass (V4.1) HyperConnection needs Streams from enter_streams(single_pass=True)")
        return self._collapse(streams.x_NcH, pre_Nc), m

    def write_output(self, y_NH: torch.Tensor, streams: Streams, m: HCMixes) -> Streams:
        """New streams from the sublayer's output y_NH [N, H] and the streams it read; V4.1 carries
        this sublayer's pre mix on to the next."""
        x_NcH = self._write_back(y_NH, streams.x_NcH, m.post_Nc, m.comb_Ncc)
        return Streams(x_NcH, m.pre_Nc if self.single_pass else None)

    def forward(self, streams: Streams, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> Streams:
        """streams -> sublayer input [N, H] -> sublayer (its own norm included) -> new streams."""
        h_NH, m = self.read_input(streams)
        return self.write_output(sublayer(h_NH), streams, m)


class HyperHead(nn.Module):
    """V4's readout before the final norm (= transformers' `DeepseekV4HyperHead`): streams collapsed by
    sigmoid(fn-projection * scale + base) + hc_eps. fn [c, X], base [c], scale [1], fp32."""

    def __init__(
        self,
        hidden_size: int,
        *,
        hc_mult: int,
        hc_eps: float,
        norm_eps: float,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        _check_hc(hidden_size, hc_mult)
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        kw = dict(dtype=torch.float32, device=device)
        self.fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size, **kw))
        self.base = nn.Parameter(torch.zeros(hc_mult, **kw))
        self.scale = nn.Parameter(torch.ones(1, **kw))
        nn.init.normal_(self.fn, std=0.02)

    def forward(self, x_NcH: torch.Tensor) -> torch.Tensor:
        """x_NcH [N, c, H] -> [N, H] in x's dtype."""
        raw_Nc = normalized_projection(x_NcH, self.fn, self.norm_eps)
        pre_Nc = torch.sigmoid(raw_Nc * self.scale.float() + self.base.float()) + self.hc_eps
        return collapse(x_NcH, pre_Nc)
