"""RoutedExperts: the experts (or intermediate slice) one rank holds, and the seam to the expert kernels."""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from epdraft.config.ffn import ActivationSpec
from epdraft.config.quant import QuantSpec
from epdraft.errors import LoadError
from epdraft.kernels.experts.fused import fused_experts
from epdraft.kernels.experts.e2m1 import shift_unpack
from epdraft.kernels.experts.e4m3 import count_nan_codes
from epdraft.kernels.experts.weights import ExpertWeights
from epdraft.layers.experts import experts_reference
from epdraft.loading import ExpertShard
from epdraft.loading.quant import dequantize_weights

log = logging.getLogger(__name__)

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


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    """One line per distinct message and process: the storage of the experts is a load-time fact."""
    log.info(message)


def run_experts(
    rows_RH: torch.Tensor,
    ids_RK: torch.Tensor,
    weights_RK: torch.Tensor,
    w13_eNH: torch.Tensor | ExpertWeights,
    w2_eHF: torch.Tensor | ExpertWeights,
    act: ActivationSpec,
    b13_eN: torch.Tensor | None = None,
    b2_eH: torch.Tensor | None = None,
) -> torch.Tensor:
    """The one place RoutedExperts computes: the same contract as `experts_reference`.

    bf16/fp16 CUDA tensors go through the fused Triton kernels (`epdraft.kernels`); fp32 (any
    device) and CPU tensors through the reference loop; the two are held against each other by
    tests/gpu/test_fused_moe.py. Quantized weights (`ExpertWeights`) go through the quantized
    kernels on CUDA with bf16 rows, else through the reference on their dequantization.

    Args:
        rows_RH: [R, H] dispatched rows; R may be 0.
        ids_RK: [R, K] int64 local expert ids in [0, e), -1 = skip.
        weights_RK: [R, K] fp32 combine weights.
        w13_eNH, w2_eHF, b13_eN, b2_eH: see `epdraft.layers.experts`.
    Returns:
        [R, H] in rows' dtype.
    """
    if isinstance(w13_eNH, ExpertWeights):
        if rows_RH.is_cuda and rows_RH.dtype == torch.bfloat16:
            from epdraft.kernels.experts.fused import fused_experts_quantized

            return fused_experts_quantized(rows_RH, ids_RK, weights_RK, w13_eNH, w2_eHF, act, b13_eN, b2_eH)
        w13_eNH, w2_eHF = dequantize_weights(w13_eNH, rows_RH.dtype), dequantize_weights(w2_eHF, rows_RH.dtype)
    impl = fused_experts if rows_RH.is_cuda and rows_RH.dtype in _FUSED_DTYPES else experts_reference
    return impl(rows_RH, ids_RK, weights_RK, w13_eNH, w2_eHF, act, b13_eN, b2_eH)


class RoutedExperts(nn.Module):
    """Weights of the routed experts held by this rank.

    Parameters: `w13 [e, 2F, H]` (gate rows, then up rows), `w2 [e, H, F]`, and with expert biases
    `b13 [e, 2F]`, `b2 [e, H]`. Under moe_tp, `b2` is zero on tp_rank != 0 so that summing the TP
    ranks' partial outputs adds it once.

    With `quantization` (the checkpoint stores the experts quantized and the fused kernels can run
    them: `DraftMoeFFNSpec.quantized_kernel_reason`), w13 / w2 hold the stored values and
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
    ) -> None:
        super().__init__()
        self.shard = shard
        self.activation = activation
        self.quantization = quantization
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
        """Once loaded, on CUDA: MXFP4 weights whose scales allow it (every e8m0 exponent <= 128) are
        re-laid for the fused kernels' table-free decode (`ExpertWeights.shift_packed`), the same
        weights read with fewer instructions; FP8 weights holding a NaN code are refused (LoadError
        naming `name`, the module's path): the kernels' decode would read it as +-480, not NaN, and
        the step's NaN guard would never see it. Reads to the host: not for a captured step."""
        if self.quantization is None or self.w13.device.type != "cuda":
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
        return run_experts(rows_RH, ids_RK, weights_RK, w13, w2, self.activation, self.b13, self.b2)

    def extra_repr(self) -> str:
        s = self.shard
        experts = f"experts [{s.first}, {s.first + s.count}) of {s.num_experts}"
        stored = f", {self.quantization.method}" if self.quantization is not None else ""
        return f"{experts}, F={s.slice_size} of I={s.intermediate_size}{stored}"


def experts_storage(quantization: QuantSpec | None, reason: str | None, dtype: torch.dtype | None) -> QuantSpec | None:
    """The quantization RoutedExperts keep (None: plain weights), logging the choice once per process.

    `reason` is `DraftMoeFFNSpec.quantized_kernel_reason` (None: the fused kernels can run them).
    """
    if quantization is None:
        return None
    if reason is None:
        _log_once(f"routed experts kept in {quantization.method} for the fused kernels; other quantized "
                  "tensors of the checkpoint are dequantized at load")
        return quantization
    _log_once(f"{quantization.method} checkpoint dequantized to {str(dtype).removeprefix('torch.')} at load "
              f"({reason})")
    return None
