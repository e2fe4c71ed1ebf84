"""RoutedExperts: the experts (or intermediate slice) one rank holds, and the seam to the expert kernels."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from epdraft.config.ffn import ActivationSpec
from epdraft.config.quant import QuantSpec
from epdraft.errors import LoadError
from epdraft.kernels.experts.fused import fused_experts, fused_experts_quantized
from epdraft.kernels.experts.e2m1 import shift_unpack
from epdraft.kernels.experts.e4m3 import count_nan_codes
from epdraft.kernels.experts.weights import ExpertWeights
from epdraft.layers.experts import experts_reference
from epdraft.layers.step_kernels import StepKernels
from epdraft.loading import ExpertShard
from epdraft.loading.quant import dequantize_weights

ExpertsFn = Callable[..., torch.Tensor]


def _dequantized_reference(rows_RH, ids_RK, weights_RK, w13, w2, act, b13_eN=None, b2_eH=None) -> torch.Tensor:
    """The reference loop on quantized weights' dequantization (a quantized store without the fused
    kernels: tests of the loader; never what `StepKernels.resolve` picks)."""
    w13_eNH, w2_eHF = dequantize_weights(w13, rows_RH.dtype), dequantize_weights(w2, rows_RH.dtype)
    return experts_reference(rows_RH, ids_RK, weights_RK, w13_eNH, w2_eHF, act, b13_eN, b2_eH)


def experts_fn(fused: bool, quantized: bool) -> ExpertsFn:
    """The one function RoutedExperts computes with, picked at construction: the fused Triton
    kernels (`epdraft.kernels.experts`), on quantized `ExpertWeights` or plain tensors, or the
    per-expert reference loop (`experts_reference`, which they are held against by
    tests/gpu/test_fused_moe*.py). Every one has `experts_reference`'s contract:

        fn(rows_RH [R, H], ids_RK [R, K] int64 local ids (-1 = skip), weights_RK [R, K] fp32,
           w13, w2, act, b13_eN, b2_eH) -> [R, H] in rows' dtype; R may be 0.
    """
    if fused:
        return fused_experts_quantized if quantized else fused_experts
    return _dequantized_reference if quantized else experts_reference


class RoutedExperts(nn.Module):
    """Weights of the routed experts held by this rank.

    Parameters: `w13 [e, 2F, H]` (gate rows, then up rows), `w2 [e, H, F]`, and with expert biases
    `b13 [e, 2F]`, `b2 [e, H]`. Under moe_tp, `b2` is zero on tp_rank != 0 so that summing the TP
    ranks' partial outputs adds it once.

    The experts compute with the function `kernels` picks at construction (`experts_fn`; None:
    resolved for `device` and `dtype`). With `quantization` (the checkpoint stores the experts
    quantized and `StepKernels.quantized_experts` keeps them so), w13 / w2 hold the stored values and
    `w13_scale` / `w2_scale` their scales, in `epdraft.kernels.experts.weights` layout (mxfp4: uint8
    `[e, 2F, H/2]` + e8m0 `[e, 2F, H/32]`; fp8: e4m3 `[e, 2F, H]` + fp32 `[e, 2F/128, H/128]`);
    never cast such a module's dtype. `pack_for_kernels` (after loading) may then permute mxfp4
    bytes for the kernels' table-free decode; `w13_packing` / `w2_packing` say which layout is held.
    """

    def __init__(
        self,
        shard: ExpertShard,
        activation: ActivationSpec,
        *,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        quantization: QuantSpec | None = None,
        kernels: StepKernels | None = None,
    ) -> None:
        super().__init__()
        self.shard = shard
        self.activation = activation
        self.quantization = quantization
        kernels = kernels if kernels is not None else StepKernels.for_device(device, dtype)
        self.fused = kernels.experts == "fused"
        self._compute = experts_fn(self.fused, quantization is not None)
        e, F_, H = shard.count, shard.slice_size, shard.hidden_size
        kw = {"dtype": dtype, "device": device}
        self.w13_scale: nn.Parameter | None = None
        self.w2_scale: nn.Parameter | None = None
        self.w13_packing = self.w2_packing = "nibbles"
        self.prepared_for_kernels = False  # `pack_for_kernels` ran: a reload runs it again
        if quantization is None:
            self.w13 = nn.Parameter(torch.empty(e, 2 * F_, H, **kw), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(e, H, F_, **kw), requires_grad=False)
        else:
            self._init_quantized(quantization, e, F_, H, device)
        self.b13: nn.Parameter | None = None
        self.b2: nn.Parameter | None = None
        if bias:
            self.b13 = nn.Parameter(torch.zeros(e, 2 * F_, **kw), requires_grad=False)
            self.b2 = nn.Parameter(torch.zeros(e, H, **kw), requires_grad=False)

    def _init_quantized(self, q: QuantSpec, e: int, F_: int, H: int, device) -> None:
        def param(*shape, dtype):
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        if q.method == "mxfp4":
            self.w13, self.w13_scale = param(e, 2 * F_, H // 2, dtype=torch.uint8), param(e, 2 * F_, H // 32,
                                                                                          dtype=torch.uint8)
            self.w2, self.w2_scale = param(e, H, F_ // 2, dtype=torch.uint8), param(e, H, F_ // 32, dtype=torch.uint8)
        else:
            bn, bk = q.block
            self.w13 = param(e, 2 * F_, H, dtype=torch.float8_e4m3fn)
            self.w13_scale = param(e, 2 * F_ // bn, -(-H // bk), dtype=torch.float32)
            self.w2 = param(e, H, F_, dtype=torch.float8_e4m3fn)
            self.w2_scale = param(e, -(-H // bn), -(-F_ // bk), dtype=torch.float32)

    def weights(self) -> tuple[torch.Tensor | ExpertWeights, torch.Tensor | ExpertWeights]:
        """(w13, w2) as the kernels take them: plain tensors, or `ExpertWeights` when held quantized."""
        q = self.quantization
        if q is None:
            return self.w13, self.w2
        return (ExpertWeights(self.w13.data, self.w13_scale.data, q.method, q.block, self.w13_packing),
                ExpertWeights(self.w2.data, self.w2_scale.data, q.method, q.block, self.w2_packing))

    def pack_for_kernels(self, name: str = "experts") -> None:
        """Once loaded, for the fused kernels: MXFP4 weights whose scales allow it (every e8m0 exponent <= 128) are
        re-laid for the fused kernels' table-free decode (`ExpertWeights.shift_packed`), the same
        weights read with fewer instructions; FP8 weights holding a NaN code are refused (LoadError
        naming `name`, the module's path): the kernels' decode would read it as +-480, not NaN, and
        the step's NaN guard would never see it. Reads to the host: not for a captured step."""
        if self.quantization is None or not self.fused:
            return
        if self.quantization.method == "fp8":
            for label, w in (("w13 (gate/up)", self.w13), ("w2 (down)", self.w2)):
                if bad := count_nan_codes(w.data):
                    raise LoadError(f"{name}.{label}: {bad} of {w.numel()} FP8 e4m3 values are NaN, expected finite "
                                    "weights (the fused kernels cannot run them)")
        else:
            w13, w2 = (w.shift_packed() for w in self.weights())
            self.w13.data, self.w13_packing = w13.values, w13.packing
            self.w2.data, self.w2_packing = w2.values, w2.packing
        self.prepared_for_kernels = True

    def unpack_for_loading(self) -> bool:
        """Put shift-packed MXFP4 bytes back in checkpoint order, so that tensors loaded into them land
        where the loader expects; True when `pack_for_kernels` had run (the caller runs it again after
        the load: the re-lay, and FP8's NaN check on what was loaded)."""
        if self.w13_packing == "shift":
            self.w13.data, self.w13_packing = shift_unpack(self.w13.data), "nibbles"
        if self.w2_packing == "shift":
            self.w2.data, self.w2_packing = shift_unpack(self.w2.data), "nibbles"
        prepared, self.prepared_for_kernels = self.prepared_for_kernels, False
        return prepared

    def forward(self, rows_RH: torch.Tensor, ids_RK: torch.Tensor, weights_RK: torch.Tensor) -> torch.Tensor:
        """rows_RH [R, H], ids_RK [R, K] local ids (-1 = skip), weights_RK [R, K] fp32 -> [R, H]."""
        w13, w2 = self.weights()
        return self._compute(rows_RH, ids_RK, weights_RK, w13, w2, self.activation, self.b13, self.b2)

    def extra_repr(self) -> str:
        s = self.shard
        experts = f"experts [{s.first}, {s.first + s.count}) of {s.num_experts}"
        stored = f", {self.quantization.method}" if self.quantization is not None else ""
        return f"{experts}, F={s.slice_size} of I={s.intermediate_size}{stored}"
