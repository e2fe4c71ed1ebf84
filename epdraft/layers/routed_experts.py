"""RoutedExperts: the experts (or intermediate slice) one rank holds, and the seam to the expert kernels."""

from __future__ import annotations

import torch
from torch import nn

from epdraft.config.ffn import ActivationSpec
from epdraft.kernels import fused_experts
from epdraft.layers.experts import experts_reference
from epdraft.loading import ExpertShard


_FUSED_DTYPES = (torch.bfloat16, torch.float16)


def reference_fallback_reason(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why experts on `device` in `dtype` run the per-expert reference loop instead of the fused
    kernels, or None when they do not (on CPU the loop is the only path, so no reason is given)."""
    if torch.device(device).type == "cuda" and dtype not in _FUSED_DTYPES:
        return (
            f"the fused Triton expert kernels take bfloat16/float16 and the draft is {str(dtype).removeprefix('torch.')}: "
            "the experts run the per-expert reference loop (slow); use --dtype bfloat16"
        )
    return None


def run_experts(
    rows_RH: torch.Tensor,
    ids_RK: torch.Tensor,
    weights_RK: torch.Tensor,
    w13_eNH: torch.Tensor,
    w2_eHF: torch.Tensor,
    act: ActivationSpec,
    b13_eN: torch.Tensor | None = None,
    b2_eH: torch.Tensor | None = None,
) -> torch.Tensor:
    """The one place RoutedExperts computes: the same contract as `experts_reference`.

    bf16/fp16 CUDA tensors go through the fused Triton kernels (`epdraft.kernels`); fp32 (any
    device) and CPU tensors through the reference loop; the two are held against each other by
    tests/gpu/test_fused_moe.py.

    Args:
        rows_RH: [R, H] dispatched rows; R may be 0.
        ids_RK: [R, K] int64 local expert ids in [0, e), -1 = skip.
        weights_RK: [R, K] fp32 combine weights.
        w13_eNH, w2_eHF, b13_eN, b2_eH: see `epdraft.layers.experts`.
    Returns:
        [R, H] in rows' dtype.
    """
    impl = fused_experts if rows_RH.is_cuda and rows_RH.dtype in _FUSED_DTYPES else experts_reference
    return impl(rows_RH, ids_RK, weights_RK, w13_eNH, w2_eHF, act, b13_eN, b2_eH)


class RoutedExperts(nn.Module):
    """Weights of the routed experts held by this rank.

    Parameters: `w13 [e, 2F, H]` (gate rows, then up rows), `w2 [e, H, F]`, and with expert biases
    `b13 [e, 2F]`, `b2 [e, H]`. Under moe_tp, `b2` is zero on tp_rank != 0 so that summing the TP
    ranks' partial outputs adds it once.
    """

    def __init__(
        self,
        shard: ExpertShard,
        activation: ActivationSpec,
        *,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.shard = shard
        self.activation = activation
        e, F_, H = shard.count, shard.slice_size, shard.hidden_size
        kw = {"dtype": dtype, "device": device}
        self.w13 = nn.Parameter(torch.empty(e, 2 * F_, H, **kw), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, H, F_, **kw), requires_grad=False)
        self.b13: nn.Parameter | None = None
        self.b2: nn.Parameter | None = None
        if bias:
            self.b13 = nn.Parameter(torch.zeros(e, 2 * F_, **kw), requires_grad=False)
            self.b2 = nn.Parameter(torch.zeros(e, H, **kw), requires_grad=False)

    def forward(self, rows_RH: torch.Tensor, ids_RK: torch.Tensor, weights_RK: torch.Tensor) -> torch.Tensor:
        """rows_RH [R, H], ids_RK [R, K] local ids (-1 = skip), weights_RK [R, K] fp32 -> [R, H]."""
        return run_experts(rows_RH, ids_RK, weights_RK, self.w13, self.w2, self.activation, self.b13, self.b2)

    def extra_repr(self) -> str:
        s = self.shard
        experts = f"experts [{s.first}, {s.first + s.count}) of {s.num_experts}"
        return f"{experts}, F={s.slice_size} of I={s.intermediate_size}"
