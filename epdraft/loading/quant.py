"""MXFP4 and block-scaled FP8 weights: dequantization (the reference every quantized kernel is held
against, also of the kernels' `ExpertWeights`) and the quantizers that make test checkpoints.

Formats (see `epdraft.config.quant`): MXFP4 packs two e2m1 values per byte, element 2j in the low
nibble and 2j+1 in the high one, 16 bytes per group of 32 that share one e8m0 exponent s
(value = e2m1 * 2**(s - 127); s = 255 is NaN). DeepSeek-V4's FP4 experts are the same bytes and
exponents stored as int8 `[N, K/2]` and float8_e8m0fnu `[N, K/32]` (`fp4_as_mxfp4` reinterprets
them, no copy). FP8 holds e4m3 values with one fp32 or e8m0 scale per (bn x bk) block, the last
row/column blocks possibly partial (value = fp8 * scale). All are dequantized by exact fp32
arithmetic rounded once to the output dtype, which is what transformers' dequantizers compute too
(tests/loading/test_quant.py holds them bit for bit).
"""

from __future__ import annotations

import torch

from epdraft.config.quant import MXFP4_GROUP
from epdraft.kernels.experts.e2m1 import shift_unpack
from epdraft.kernels.experts.weights import ExpertWeights

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 e2m1 codes: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""

E2M1_MAX = 6.0
FP8_E4M3_MAX = 448.0


E8M0_DTYPES = (torch.uint8, torch.float8_e8m0fnu)
"""How e8m0 exponents are stored: raw bytes (transformers' mxfp4) or torch's own dtype (DeepSeek's `.scale`)."""


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """fp32 2**(s - 127) of e8m0 exponents (uint8 or float8_e8m0fnu), built from the bits (no pow:
    exact for every s)."""
    s = scales.view(torch.uint8).to(torch.int32)
    # s >= 1: a normal fp32 with biased exponent s; s = 0: the subnormal 2**-127 (bit 22).
    bits = torch.where(s > 0, s << 23, torch.full_like(s, 1 << 22))
    bits = torch.where(s == 255, torch.full_like(s, 0x7FC00000), bits)
    return bits.view(torch.float32)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., N, G, 16] uint8 blocks and [..., N, G] uint8 e8m0 scales -> [..., N, 32 G] in `dtype`."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.int32)
    values = torch.stack((lut[codes & 0xF], lut[codes >> 4]), dim=-1).flatten(-2)  # [..., N, G, 32]
    values = values * e8m0_to_float(scales).unsqueeze(-1)  # a power of two: exact in fp32
    return values.flatten(-2).to(dtype)


def fp4_as_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's FP4 (int8 `[..., N, K/2]`, e8m0 `[..., N, K/32]`) as MXFP4 blocks `[..., N, K/32, 16]`
    uint8 and scales uint8: the same bytes reinterpreted (views, no copy; K/2 must be whole groups of 16)."""
    return packed.view(torch.uint8).unflatten(-1, (-1, MXFP4_GROUP // 2)), scale.view(torch.uint8)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., N, K/2] int8 of packed e2m1 (low nibble first) and [..., N, K/32] e8m0 -> [..., N, K] in `dtype`."""
    return dequantize_mxfp4(*fp4_as_mxfp4(packed, scale), dtype)


def expand_block_scales(scale: torch.Tensor, block: tuple[int, int], rows: slice, cols: slice) -> torch.Tensor:
    """Per-element scales of weight[..., rows, cols] from the per-block `scale` of the blocks they touch.

    `scale` holds the blocks from row block rows.start // bn and column block cols.start // bk on.
    """
    bn, bk = block
    expanded = scale.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    r0, c0 = rows.start % bn, cols.start % bk
    return expanded[..., r0 : r0 + rows.stop - rows.start, c0 : c0 + cols.stop - cols.start]


def dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """[..., N, K] float8_e4m3fn weight times its [..., ceil(N/bn), ceil(K/bk)] block scales, in `dtype`.

    fp32 scales are used as stored; uint8 / float8_e8m0fnu ones are e8m0 exponents (`scale_fmt: ue8m0`).
    """
    scale32 = e8m0_to_float(scale) if scale.dtype in E8M0_DTYPES else scale.float()
    N, K = weight.shape[-2:]
    full = expand_block_scales(scale32, block, slice(0, N), slice(0, K))
    return (weight.float() * full).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float (K % 32 == 0) -> (blocks [..., N, K/32, 16] uint8, scales [..., N, K/32] uint8).

    Per group: the exponent that puts its largest magnitude at or below e2m1's 6, each value rounded
    to the nearest e2m1 code (ties to the lower magnitude). Good enough for test checkpoints.
    """
    *lead, N, K = weight.shape
    groups = weight.float().reshape(*lead, N, K // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(dim=-1)
    # smallest e with amax / 2**e <= 6; all-zero groups get 2**-127 (code 0)
    exponent = torch.ceil(torch.log2(amax.clamp_min(2.0**-126) / E2M1_MAX)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    magnitudes = torch.tensor(E2M1_VALUES[:8], device=weight.device)
    codes = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)
    codes = codes + 8 * ((scaled < 0) & (codes > 0))
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent + 127).to(torch.uint8)


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float (K % 32 == 0) -> DeepSeek's FP4: (int8 [..., N, K/2], float8_e8m0fnu [..., N, K/32]),
    `quantize_mxfp4`'s codes and exponents in DeepSeek's storage."""
    blocks, scales = quantize_mxfp4(weight)
    return blocks.flatten(-2).view(torch.int8), scales.view(torch.float8_e8m0fnu)


def quantize_fp8(
    weight: torch.Tensor, block: tuple[int, int], *, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (float8_e4m3fn weight, scales [..., ceil(N/bn), ceil(K/bk)]).

    One scale per block maps its largest magnitude to e4m3's 448 (DeepSeek-V3's recipe): fp32
    (`weight_scale_inv`), or with `ue8m0` rounded up to a power of two and stored float8_e8m0fnu
    (DeepSeek-V4's `.scale`, `scale_fmt: ue8m0`).
    """
    bn, bk = block
    *lead, N, K = weight.shape
    nb, kb = -(-N // bn), -(-K // bk)
    padded = torch.zeros(*lead, nb * bn, kb * bk, dtype=torch.float32, device=weight.device)
    padded[..., :N, :K] = weight.float()
    tiles = padded.reshape(*lead, nb, bn, kb, bk)
    amax = tiles.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    if ue8m0:  # the next power of two up keeps every value within e4m3's range
        scale = torch.exp2(torch.ceil(torch.log2(scale)).clamp(-127, 127))
    full = expand_block_scales(scale, block, slice(0, N), slice(0, K))
    values = (weight.float() / full).to(torch.float8_e4m3fn)
    return values, (scale.to(torch.float8_e8m0fnu) if ue8m0 else scale)


def dequantize_weights(w: ExpertWeights, dtype: torch.dtype) -> torch.Tensor:
    """[e, N, K] in `dtype` of expert weights as the fused kernels hold them (any packing): the
    reference the kernels are held against, and the experts' weights where the kernels cannot run."""
    if w.format == "bf16":
        return w.values.to(dtype)
    if w.format == "fp8":
        return dequantize_fp8(w.values, w.scales, w.block, dtype)
    e, N, k = w.values.shape
    values = shift_unpack(w.values) if w.packing == "shift" else w.values
    return dequantize_mxfp4(values.view(e, N, k // 16, 16), w.scales, dtype)


def quantize_weights(w: torch.Tensor, weights: str) -> ExpertWeights:
    """`w` [e, N, K] as `ExpertWeights` in format `weights` ("bf16", "fp8" with 128 x 128 blocks, or
    "mxfp4"), by the quantizers above: random expert sets for the kernels' tests, tuner and bench."""
    if weights == "bf16":
        return ExpertWeights(w)
    # one expert at a time: the quantizers' fp32 temporaries of a whole C/D weight would not fit
    if weights == "fp8":
        parts = [quantize_fp8(w[i], (128, 128)) for i in range(w.shape[0])]
        return ExpertWeights(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), "fp8", (128, 128))
    parts = [quantize_mxfp4(w[i]) for i in range(w.shape[0])]
    blocks = torch.stack([p[0] for p in parts])
    e, N, G, _ = blocks.shape
    return ExpertWeights(blocks.reshape(e, N, G * 16), torch.stack([p[1] for p in parts]), "mxfp4")
