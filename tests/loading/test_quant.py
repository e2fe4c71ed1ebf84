"""epdraft.loading.quant: MXFP4 and FP8 dequantization equal transformers' dequantizers bit for bit."""

from __future__ import annotations

import pytest
import torch

from epdraft.loading.quant import dequantize_fp8, dequantize_mxfp4, e8m0_to_float, quantize_fp8, quantize_mxfp4

mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
finegrained_fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_mxfp4_equals_transformers_on_every_code_and_exponent(dtype):
    """Every byte (both nibbles) under every finite e8m0 exponent: 256 x 255 groups of 32."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(16).reshape(16, 16, 16)  # each byte 16 times
    blocks = codes.reshape(1, 16, 16, 16).repeat(255, 1, 1, 1)  # [255 "experts", N=16, G=16, 16]
    scales = torch.arange(255, dtype=torch.uint8).reshape(255, 1, 1).expand(255, 16, 16).contiguous()
    if dtype == torch.float16:  # fp16 cannot hold most exponents: compare where transformers is finite
        scales = scales.clamp(127 - 14, 127 + 12)
    want = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, K, N] (transposed)
    got = dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2)
    assert torch.equal(_bits(got), _bits(want))


def test_mxfp4_random_tensor_and_nan_scale():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (4, 40, 6, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(100, 150, (4, 40, 6), dtype=torch.uint8, generator=gen)
    want = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert torch.equal(_bits(dequantize_mxfp4(blocks, scales, torch.bfloat16).transpose(1, 2)), _bits(want))
    # OCP MX: e8m0 255 is NaN (transformers' ldexp gives inf instead); exponents 0..254 are exact powers of two
    assert torch.isnan(e8m0_to_float(torch.tensor([255], dtype=torch.uint8))).all()
    exps = torch.arange(255, dtype=torch.uint8)
    assert torch.equal(e8m0_to_float(exps).double(), torch.pow(2.0, exps.double() - 127))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.uint8])
def test_fp8_equals_transformers_block_dequantizer(dtype, scale_dtype):
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(3, 256, 384, generator=gen) * 100).to(torch.float8_e4m3fn)
    if scale_dtype == torch.uint8:  # ue8m0 scales (scale_fmt: ue8m0)
        scale = torch.randint(110, 140, (3, 2, 3), dtype=torch.uint8, generator=gen)
    else:
        scale = torch.rand(3, 2, 3, generator=gen) * 1e-2
    want = finegrained_fp8.Fp8Dequantize(None)._dequantize_one(weight, scale, dtype)
    got = dequantize_fp8(weight, scale, (128, 128), dtype)
    assert torch.equal(_bits(got), _bits(want))


def test_fp8_partial_blocks_equal_an_elementwise_loop():
    """Shapes not a multiple of the block (I = 96 with 128 x 128 blocks): the last blocks are partial."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(200, 96, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(4, 2, generator=gen)
    block = (64, 80)
    got = dequantize_fp8(weight, scale, block, torch.float32)
    want = torch.empty(200, 96)
    for r in range(200):
        for c in range(96):
            want[r, c] = weight[r, c].float() * scale[r // 64, c // 80]
    assert torch.equal(got, want)


def test_quantizers_round_trip_within_their_format_error():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(4, 96, 128, generator=gen)
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (4, 96, 4, 16) and scales.shape == (4, 96, 4) and blocks.dtype == scales.dtype == torch.uint8
    # e2m1 keeps ~1 mantissa bit: relative RMS error about 0.1 on Gaussian data, no group scaled past 6
    err = (dequantize_mxfp4(blocks, scales, torch.float32) - w).norm() / w.norm()
    assert err < 0.15
    exact = torch.tensor([[0.5, -1.5, 6.0, -6.0, 3.0, 0.0, 2.0, -4.0] * 4])  # e2m1 values at scale 1
    b, s = quantize_mxfp4(exact)
    assert s.item() == 127 and torch.equal(dequantize_mxfp4(b, s, torch.float32), exact)
    q, scale = quantize_fp8(w, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (4, 1, 1)
    assert (dequantize_fp8(q, scale, (128, 128), torch.float32) - w).norm() / w.norm() < 0.04
