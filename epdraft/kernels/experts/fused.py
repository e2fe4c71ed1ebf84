"""Fused routed experts on the GPU: the Triton counterpart of `epdraft.layers.experts.experts_reference`.

Four launches (and, with split-K in the gate/up GEMM, a memset of its tile counters), no host
synchronization (CUDA-graph safe):
    align_pairs        pairs sorted by expert into block-padded groups
    gemm1_act_kernel   h = act(x W13^T + b13) per sorted row (gate and up tiles in one program;
                       with split-K, the last program of a tile sums the partials and activates)
    gemm2_weight_kernel  w_pair * (h W2^T + b2) per pair (and per split of F)
    topk_sum_kernel    y[t] = sum over the token's pairs (and splits) in fp32, in a fixed order
With one choice per row (K = 1, e.g. rows an all-to-all dispatcher delivered) and no split, the
down GEMM writes y's rows directly and the sum launch is skipped; rows with id -1 stay zero.
The weights may be bf16/fp16, FP8 e4m3 with block scales or MXFP4 (`ExpertWeights`): the GEMMs
dequantize each tile right after its load; activations stay bf16 and accumulation fp32. MXFP4 tiles
are upcast one of two ways (`mxfp4_upcast`): "bits" builds the bf16 weights with integer ops
(`epdraft.kernels.experts.e2m1`) and multiplies the activations' even and odd K columns apart; "dot_scaled"
hands the packed tile and its scales to `tl.dot_scaled`. Both equal the dequantized reference.
Shift-packed MXFP4 weights (`ExpertWeights.shift_packed`) take the bits path's table-free decode.
"""

from __future__ import annotations

from typing import Literal, Protocol, get_args

import torch

from epdraft.errors import ConfigError
from epdraft.kernels import launch
from epdraft.kernels.experts.align import AlignedPairs, align_pairs
from epdraft.kernels.experts.tables import DownConfig, GemmConfig, MoeKernelConfig, UpConfig, dtype_name, fit_format, get_config
from epdraft.kernels.experts.weights import ExpertWeights, as_weights

_TOPK_SUM_BLOCK_H = 1024


class Activation(Protocol):
    """The gated activation the up GEMM applies (`epdraft.config.ffn.ActivationSpec` is one):
    kind "swiglu" (silu(gate) * up) or "swigluoai" (gpt-oss's, with `alpha`), clamped at `limit`
    when it is > 0."""

    kind: str
    limit: float
    alpha: float

Mxfp4Upcast = Literal["bits", "dot_scaled"]
MXFP4_UPCAST: Mxfp4Upcast = "bits"
"""How the kernels upcast MXFP4 tiles unless told otherwise (`epdraft bench kernel` times both)."""


_DTYPES = (torch.bfloat16, torch.float16)


def unsupported_reason(device_type: str, dtype: torch.dtype) -> str | None:
    """Why `fused_experts` cannot run on `device_type` with activations and weights in `dtype`, or None."""
    if (why := launch.unsupported_reason(device_type)) is not None:
        return why
    if dtype not in _DTYPES:
        return (f"the fused expert kernels take bfloat16/float16 and the draft is {str(dtype).removeprefix('torch.')}: "
                "the experts run the per-expert reference loop (slow); use --dtype bfloat16")
    return None


def quantized_unsupported_reason(
    method: str, block: tuple[int, int], hidden: int, intermediate: int, device_type: str, dtype: torch.dtype
) -> str | None:
    """Why `fused_experts_quantized` cannot run experts of `hidden` x `intermediate` stored in
    `method` ("fp8" with `block` scale blocks, or "mxfp4") here, or None: bf16 activations on CUDA,
    reductions H and F that are multiples of 64 (whole K tiles), and for FP8 128 x 128 scale blocks
    with the gate/up boundary on a block row (F % 128 == 0). Whether Triton runs here at all is
    `unsupported_reason`'s to say."""
    if device_type != "cuda" or dtype != torch.bfloat16:
        return f"quantized experts run on CUDA with bf16 activations; here {device_type}, {str(dtype).removeprefix('torch.')}"
    if hidden % 64 or intermediate % 64:
        return f"hidden {hidden} and intermediate {intermediate} must be multiples of 64"
    if method == "fp8" and (tuple(block) != (128, 128) or intermediate % 128):
        return f"fp8 experts need 128 x 128 scale blocks and I % 128 == 0 (block {list(block)}, I = {intermediate})"
    return None


def _check_inputs(x_TH, ids_TK, weights_TK, w13_eNH, w2_eHF, b13_eN, b2_eH) -> None:
    """Raise ConfigError naming the tensor whose shape, dtype, device or layout the kernels cannot take."""
    if w13_eNH.dim() != 3 or w2_eHF.dim() != 3:
        raise ConfigError(
            f"fused_experts: w13_eNH {tuple(w13_eNH.shape)} and w2_eHF {tuple(w2_eHF.shape)} must be 3-d"
        )
    _check_shapes(x_TH, ids_TK, weights_TK, tuple(w13_eNH.shape), tuple(w2_eHF.shape), b13_eN, b2_eH)
    for name, t in (("w13_eNH", w13_eNH), ("w2_eHF", w2_eHF)):
        if t.device != x_TH.device:
            raise ConfigError(f"fused_experts: {name} is on {t.device}, x_TH on {x_TH.device}")
        if t.dtype != x_TH.dtype:
            raise ConfigError(f"fused_experts: {name} is {t.dtype}, x_TH is {x_TH.dtype}; they must match")
        if not t.is_contiguous():
            raise ConfigError(f"fused_experts: {name} must be contiguous (strides {t.stride()})")


def _check_shapes(x_TH, ids_TK, weights_TK, w13_shape, w2_shape, b13_eN, b2_eH) -> None:
    """The checks every weight format shares: x, routing, the (dequantized) weight shapes, biases."""
    dtype_name(x_TH.dtype)
    if not x_TH.is_cuda:
        raise ConfigError(f"fused_experts: x_TH is on {x_TH.device}, expected a CUDA device")
    if x_TH.dim() != 2:
        raise ConfigError(f"fused_experts: x_TH has shape {tuple(x_TH.shape)}, expected [T, H]")
    T, H = x_TH.shape
    e, N, _ = w13_shape
    F_ = N // 2
    if ids_TK.dim() != 2 or ids_TK.shape[0] != T:
        raise ConfigError(f"fused_experts: ids_TK has shape {tuple(ids_TK.shape)}, expected [{T}, K]")
    if w13_shape != (e, 2 * F_, H):
        raise ConfigError(f"fused_experts: w13_eNH has shape {w13_shape}, expected {(e, 2 * F_, H)}")
    if w2_shape != (e, H, F_):
        raise ConfigError(f"fused_experts: w2_eHF has shape {w2_shape}, expected {(e, H, F_)}")
    expected = {"weights_TK": (weights_TK, tuple(ids_TK.shape)), "b13_eN": (b13_eN, (e, N)), "b2_eH": (b2_eH, (e, H))}
    for name, (t, shape) in expected.items():
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ConfigError(f"fused_experts: {name} has shape {tuple(t.shape)}, expected {shape}")
        if t.device != x_TH.device:
            raise ConfigError(f"fused_experts: {name} is on {t.device}, x_TH on {x_TH.device}")
    if ids_TK.dtype.is_floating_point or ids_TK.dtype == torch.bool:
        raise ConfigError(f"fused_experts: ids_TK must be an integer tensor, got {ids_TK.dtype}")
    if not weights_TK.dtype.is_floating_point:
        raise ConfigError(f"fused_experts: weights_TK must be floating point, got {weights_TK.dtype}")


def fused_experts(
    x_TH: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    w13_eNH: torch.Tensor,
    w2_eHF: torch.Tensor,
    act: Activation,
    b13_eN: torch.Tensor | None = None,
    b2_eH: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[t] = sum_j w[t,j] * (down_e(act(gate_e x, up_e x)) + b2_e) over pairs with e = ids[t,j] >= 0.

    Same contract as `experts_reference`: x_TH [T, H] bf16/fp16 on CUDA (any strides), ids_TK [T, K]
    int local expert ids (-1 = skip; ids >= e are skipped too), weights_TK [T, K] float,
    w13_eNH [e, 2F, H] and w2_eHF [e, H, F] contiguous in x's dtype, b13_eN [e, 2F], b2_eH [e, H].
    Returns [T, H] in x's dtype, each row's pairs summed in fp32 in a fixed order (deterministic).
    Launch tiles come from `epdraft.kernels.experts.tables.get_config`.

    Raises:
        ConfigError: a tensor with the wrong shape, dtype, device or layout (the message names it).
    """
    _check_inputs(x_TH, ids_TK, weights_TK, w13_eNH, w2_eHF, b13_eN, b2_eH)
    e, N, H = w13_eNH.shape
    T, K = ids_TK.shape
    config = get_config(e, N, H, x_TH.dtype, T, K, torch.cuda.get_device_name(x_TH.device))
    return fused_experts_with_config(x_TH, ids_TK, weights_TK, w13_eNH, w2_eHF, act, b13_eN, b2_eH, config)


def fused_experts_quantized(
    x_TH: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    act: Activation,
    b13_eN: torch.Tensor | None = None,
    b2_eH: torch.Tensor | None = None,
    mxfp4_upcast: Mxfp4Upcast = MXFP4_UPCAST,
) -> torch.Tensor:
    """`fused_experts` on quantized weights (`ExpertWeights`, both GEMMs in one format): the same
    result as `experts_reference` on `dequantize_weights(w13, bf16)` and `(w2, bf16)`, within bf16 drift.

    x_TH is bf16; H and F must be multiples of 64 (the kernels run whole K tiles of 64 or more) and
    FP8 scale blocks must have a multiple of 64 columns. The tuned table is the format's own
    (`weights=fp8|mxfp4` in its file name), else the shape's bf16 table cut by `fit_format`.
    `mxfp4_upcast` picks the MXFP4 tiles' upcast (module docstring); other formats ignore it.

    Raises:
        ConfigError: a tensor with the wrong shape, dtype, device or layout, or a format the kernels cannot take.
    """
    if x_TH.dtype != torch.bfloat16:
        raise ConfigError(f"fused_experts_quantized: x_TH is {x_TH.dtype}, quantized weights need bf16 activations")
    if w13.format != w2.format or w13.format == "bf16":
        raise ConfigError(
            f"fused_experts_quantized: w13 is {w13.format}, w2 {w2.format}; expected one quantized format"
        )
    e, N, H = w13.shape
    for name, w in (("w13", w13), ("w2", w2)):
        if w.values.device != x_TH.device:
            raise ConfigError(f"fused_experts_quantized: {name} is on {w.values.device}, x_TH on {x_TH.device}")
        if w.format == "fp8" and w.block[1] % 64:
            raise ConfigError(f"fused_experts_quantized: {name} fp8 block {w.block}: columns must be a multiple of 64")
    _check_shapes(x_TH, ids_TK, weights_TK, w13.shape, w2.shape, b13_eN, b2_eH)
    T, K = ids_TK.shape
    config = get_config(e, N, H, x_TH.dtype, T, K, torch.cuda.get_device_name(x_TH.device), weights=w13.format)
    config = fit_format(config, w13.format, w13.block[1], H, N // 2)
    return fused_experts_with_config(x_TH, ids_TK, weights_TK, w13, w2, act, b13_eN, b2_eH, config, mxfp4_upcast)


def fused_experts_with_config(
    x_TH: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    w13_eNH: torch.Tensor | ExpertWeights,
    w2_eHF: torch.Tensor | ExpertWeights,
    act: Activation,
    b13_eN: torch.Tensor | None,
    b2_eH: torch.Tensor | None,
    config: MoeKernelConfig,
    mxfp4_upcast: Mxfp4Upcast = MXFP4_UPCAST,
) -> torch.Tensor:
    """`fused_experts` with an explicit launch config and no input checks (the tuner and benchmarks)."""
    T, H = x_TH.shape
    if T == 0:
        return x_TH.new_zeros(0, H)
    ids_TK = ids_TK.contiguous()
    aligned = align_pairs(ids_TK.view(-1), as_weights(w13_eNH).shape[0], config.block_m)
    h_MF = up_act(x_TH, aligned, w13_eNH, b13_eN, act, config.up, mxfp4_upcast)
    return down_combine(h_MF, aligned, ids_TK, weights_TK.contiguous(), w2_eHF, b2_eH, config.down, mxfp4_upcast)


def _mxfp4_dot_scaled(w: ExpertWeights, mxfp4_upcast: str) -> bool:
    """The kernels' MXFP4_DOT_SCALED constexpr (False for every other format: one compiled kernel)."""
    if mxfp4_upcast not in get_args(Mxfp4Upcast):
        raise ConfigError(f"mxfp4_upcast = {mxfp4_upcast!r}; expected one of {list(get_args(Mxfp4Upcast))}")
    dot_scaled = w.format == "mxfp4" and mxfp4_upcast == "dot_scaled"
    if dot_scaled and w.packing == "shift":
        raise ConfigError("mxfp4_upcast = 'dot_scaled' reads checkpoint-order bytes; these weights are shift "
                          "packed (the bits upcast's table-free decode)")
    return dot_scaled


def _weight_descriptor(w: ExpertWeights, gemm: GemmConfig, dot_scaled: bool):
    """(a TMA descriptor of w's values, block [1, block_n, block_k in stored elements], True) when
    the config asks for TMA weight copies and the weights allow them; else (the values, False):
    `tl.dot_scaled`'s loads, a base or row not 16-byte aligned, a tile row under 16 bytes."""
    values = w.values
    if not gemm.weight_tma or dot_scaled:
        return values, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    cols = gemm.block_k // 2 if w.format == "mxfp4" else gemm.block_k
    size = values.element_size()
    if values.data_ptr() % 16 or (values.stride(1) * size) % 16 or cols * size < 16:
        return values, False
    return TensorDescriptor.from_tensor(values, [1, gemm.block_n, cols]), True


def _pairs_aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` [rows, K] itself if the bits path can read its K-column pairs as int32 (unit stride along
    K, even row stride, 4-byte aligned), else a contiguous copy."""
    if t.stride(1) == 1 and t.stride(0) % 2 == 0 and t.data_ptr() % 4 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def up_act(
    x_TH: torch.Tensor,
    aligned: AlignedPairs,
    w13_eNH: torch.Tensor | ExpertWeights,
    b13_eN: torch.Tensor | None,
    act: Activation,
    up: UpConfig,
    mxfp4_upcast: Mxfp4Upcast = MXFP4_UPCAST,
) -> torch.Tensor:
    """h_MF [max_rows, F] in x's dtype: the activated gate/up product of every sorted row (padding rows hold junk)."""
    from epdraft.kernels.experts._triton import ACT_SWIGLU, ACT_SWIGLUOAI, gemm1_act_kernel

    T, H = x_TH.shape
    w13 = as_weights(w13_eNH)
    dot_scaled = _mxfp4_dot_scaled(w13, mxfp4_upcast)
    if w13.format == "mxfp4" and not dot_scaled:
        x_TH = _pairs_aligned(x_TH)
    e, N, _ = w13.shape
    values = w13.values
    w_desc, w_tma = _weight_descriptor(w13, up, dot_scaled)
    scales = w13.scales if w13.scales is not None else values
    F_ = N // 2
    max_rows = aligned.sorted_pairs_M.shape[0]
    h_MF = torch.empty(max_rows, F_, dtype=x_TH.dtype, device=x_TH.device)
    n_tiles = _cdiv(F_, up.block_n)
    if up.split_k > 1:
        partials = torch.empty(up.split_k, max_rows, N, dtype=torch.float32, device=x_TH.device)
        arrived = torch.zeros(aligned.max_blocks * n_tiles, dtype=torch.int32, device=x_TH.device)
    else:
        partials = arrived = h_MF  # not read
    grid = (aligned.max_blocks * n_tiles * up.split_k,)
    gemm1_act_kernel[grid](
        x_TH,
        values,
        w_desc,
        scales,
        b13_eN if b13_eN is not None else values,
        h_MF,
        partials,
        arrived,
        aligned.sorted_pairs_M,
        aligned.block_expert_B,
        aligned.num_padded_1,
        aligned.num_pairs,
        aligned.max_blocks,
        up.group_m or aligned.max_blocks,
        F_,
        H,
        x_TH.stride(0),
        x_TH.stride(1),
        values.stride(0),
        values.stride(1),
        scales.stride(0),
        scales.stride(1),
        b13_eN.stride(0) if b13_eN is not None else 0,
        h_MF.stride(0),
        partials.stride(0) if up.split_k > 1 else 0,
        float(act.limit),
        float(act.alpha),
        TOP_K=aligned.num_pairs // T,
        ACT=ACT_SWIGLU if act.kind == "swiglu" else ACT_SWIGLUOAI,
        HAS_LIMIT=act.limit > 0,
        HAS_BIAS=b13_eN is not None,
        SPLIT_K=up.split_k,
        EVEN_K=H % (up.block_k * up.split_k) == 0,
        BLOCK_M=aligned.block_m,
        BLOCK_N=up.block_n,
        BLOCK_K=up.block_k,
        W_FMT=w13.code,
        QBN=w13.block[0] if w13.format == "fp8" else 1,  # only fp8 reads them: one compiled kernel otherwise
        QBK=w13.block[1] if w13.format == "fp8" else 1,
        MXFP4_DOT_SCALED=dot_scaled,
        W_TMA=w_tma,
        num_warps=up.num_warps,
        **launch.kwargs(x_TH.device),
        num_stages=up.num_stages,
    )
    return h_MF


def down_combine(
    h_MF: torch.Tensor,
    aligned: AlignedPairs,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    w2_eHF: torch.Tensor | ExpertWeights,
    b2_eH: torch.Tensor | None,
    down: DownConfig,
    mxfp4_upcast: Mxfp4Upcast = MXFP4_UPCAST,
) -> torch.Tensor:
    """y_TH: the weighted down projection of every pair, summed per token (ids_TK, weights_TK contiguous)."""
    from epdraft.kernels.experts._triton import gemm2_weight_kernel, topk_sum_kernel

    T, K = ids_TK.shape
    w2 = as_weights(w2_eHF)
    dot_scaled = _mxfp4_dot_scaled(w2, mxfp4_upcast)
    if w2.format == "mxfp4" and not dot_scaled:
        h_MF = _pairs_aligned(h_MF)
    e, H, F_ = w2.shape
    values = w2.values
    w_desc, w_tma = _weight_descriptor(w2, down, dot_scaled)
    scales = w2.scales if w2.scales is not None else values
    direct = K == 1 and down.split_k == 1
    if direct:
        # one pair per row: rows are written in place, a dropped (-1) row must read as zero
        y_TH = torch.zeros(T, H, dtype=h_MF.dtype, device=h_MF.device)
        out = y_TH.view(1, T, H)
    else:
        # fp32 partials when split: each split's share is rounded once, at the end
        out_dtype = torch.float32 if down.split_k > 1 else h_MF.dtype
        out = torch.empty(down.split_k, T * K, H, dtype=out_dtype, device=h_MF.device)
    grid = (aligned.max_blocks * _cdiv(H, down.block_n) * down.split_k,)
    gemm2_weight_kernel[grid](
        h_MF,
        values,
        w_desc,
        scales,
        b2_eH if b2_eH is not None else values,
        out,
        aligned.sorted_pairs_M,
        aligned.block_expert_B,
        aligned.num_padded_1,
        weights_TK,
        aligned.num_pairs,
        aligned.max_blocks,
        down.group_m or aligned.max_blocks,
        H,
        F_,
        h_MF.stride(0),
        values.stride(0),
        values.stride(1),
        scales.stride(0),
        scales.stride(1),
        b2_eH.stride(0) if b2_eH is not None else 0,
        out.stride(0),
        out.stride(1),
        HAS_BIAS=b2_eH is not None,
        SPLIT_K=down.split_k,
        EVEN_K=F_ % (down.block_k * down.split_k) == 0,
        BLOCK_M=aligned.block_m,
        BLOCK_N=down.block_n,
        BLOCK_K=down.block_k,
        W_FMT=w2.code,
        QBN=w2.block[0] if w2.format == "fp8" else 1,  # only fp8 reads them: one compiled kernel otherwise
        QBK=w2.block[1] if w2.format == "fp8" else 1,
        MXFP4_DOT_SCALED=dot_scaled,
        W_TMA=w_tma,
        num_warps=down.num_warps,
        **launch.kwargs(h_MF.device),
        num_stages=down.num_stages,
    )
    if direct:
        return y_TH
    y_TH = torch.empty(T, H, dtype=h_MF.dtype, device=h_MF.device)
    topk_sum_kernel[(T, _cdiv(H, _TOPK_SUM_BLOCK_H))](
        out,
        ids_TK,
        y_TH,
        H,
        e,
        out.stride(0),
        out.stride(1),
        y_TH.stride(0),
        TOP_K=K,
        SPLIT_K=down.split_k,
        BLOCK_H=_TOPK_SUM_BLOCK_H,
        num_warps=4,
        **launch.kwargs(y_TH.device),
    )
    return y_TH


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
