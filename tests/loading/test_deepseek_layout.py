"""DeepSeek-V4's released layout: FP8 e4m3 `.weight` with float8_e8m0fnu `.scale` per block, FP4 routed experts
as int8 pairs (low nibble first) with an e8m0 `.scale` per 32 inputs.

Dequantization is held bit for bit against transformers 5.25's own dequantizers: `Fp8Dequantize._dequantize_one`
(transformers' fine-grained FP8 loader; it reads int8 FP4 and e8m0 scales too) and
`_dequantize_fp8_weight` (its FP8 dequantizer that takes partial edge blocks). `QuantizedSource` reads the layout
under its logical names and refuses, naming the tensor, what it cannot read.
"""

from __future__ import annotations

import pytest
import torch

from epdraft.config.quant import QuantSpec
from epdraft.errors import LoadError
from epdraft.loading import QuantizedSource
from epdraft.loading.quant import (
    dequantize_fp4,
    dequantize_fp8,
    dequantize_mxfp4,
    fp4_as_mxfp4,
    quantize_fp4,
    quantize_fp8,
)

finegrained_fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")

E8M0 = torch.float8_e8m0fnu
V4 = QuantSpec(method="fp8", block=(128, 128), scale_fmt="ue8m0", expert_dtype="fp4")
V41 = QuantSpec(method="fp8", block=(32, 32), scale_fmt="ue8m0", expert_dtype="fp4")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _hf(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return finegrained_fp8.Fp8Dequantize(None)._dequantize_one(weight, scale, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp4_int8_pairs_equal_transformers_on_every_byte_and_exponent(dtype):
    """Every byte (both nibbles) under exponents 1..254: [254 experts, 16 rows, 512 inputs]."""
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8).repeat(16, 1)  # [16, 256]
    packed = packed.unsqueeze(0).repeat(254, 1, 1)
    exps = torch.arange(1, 255, dtype=torch.uint8).reshape(254, 1, 1).expand(254, 16, 16).contiguous()
    got = dequantize_fp4(packed, exps.view(E8M0), dtype)
    want = _hf(packed, exps.view(E8M0), dtype)
    assert got.shape == (254, 16, 512) and torch.equal(_bits(got), _bits(want))
    # low nibble first: byte 0x21 of group scale 1 is [0.5 (code 1), 1.0 (code 2)]
    one = torch.full((1, 16), 0x21, dtype=torch.uint8).view(torch.int8)
    assert dequantize_fp4(one, torch.tensor([[127]], dtype=torch.uint8).view(E8M0), torch.float32)[0, :2].tolist() \
        == [0.5, 1.0]


def test_fp4_is_mxfp4_reinterpreted_without_a_copy():
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(-128, 128, (6, 64), dtype=torch.int8, generator=gen)
    scale = torch.randint(110, 140, (6, 4), dtype=torch.uint8, generator=gen).view(E8M0)
    blocks, scales = fp4_as_mxfp4(packed, scale)
    assert blocks.shape == (6, 4, 16) and blocks.dtype == scales.dtype == torch.uint8
    assert blocks.data_ptr() == packed.data_ptr() and scales.data_ptr() == scale.data_ptr()
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), _hf(packed, scale, torch.float32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
def test_fp8_with_e8m0_scales_equals_transformers(dtype, block):
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(2, 256, 384, generator=gen) * 100).to(torch.float8_e4m3fn)
    scale = torch.randint(100, 140, (2, 256 // block[0], 384 // block[1]), dtype=torch.uint8, generator=gen).view(E8M0)
    assert torch.equal(_bits(dequantize_fp8(weight, scale, block, dtype)), _bits(_hf(weight, scale, dtype)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_partial_edge_blocks_equal_transformers(dtype):
    """200 x 96 under 128 x 128 blocks: the last row block is partial. transformers' `_dequantize_fp8_weight` cuts
    the scales to the weight, as ours does (its `Fp8Dequantize` derives the block from the scale grid, 200 / 2 =
    100 rows, so it is no reference for partial blocks)."""
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(200, 96, generator=gen) * 50).to(torch.float8_e4m3fn)
    scale = torch.randint(110, 140, (2, 1), dtype=torch.uint8, generator=gen).view(E8M0)
    want = finegrained_fp8._dequantize_fp8_weight(weight, scale, [128, 128], dtype)
    assert torch.equal(_bits(dequantize_fp8(weight, scale, (128, 128), dtype)), _bits(want))


def test_deepseek_quantizers_round_trip_in_their_storage():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 96, generator=gen)
    packed, scale = quantize_fp4(w)
    assert (packed.dtype, packed.shape, scale.dtype, scale.shape) == (torch.int8, (48, 48), E8M0, (48, 3))
    assert (dequantize_fp4(packed, scale, torch.float32) - w).norm() / w.norm() < 0.15
    q, s = quantize_fp8(w, (32, 32), ue8m0=True)
    assert (q.dtype, s.dtype, s.shape) == (torch.float8_e4m3fn, E8M0, (2, 3))
    s32 = s.float()
    assert torch.equal(s32, torch.exp2(torch.log2(s32).round()))  # powers of two
    assert (dequantize_fp8(q, s, (32, 32), torch.float32) - w).norm() / w.norm() < 0.05


def _layout(spec: QuantSpec, seed: int = 4):
    """{name: stored tensor} of one DeepSeek MoE stage (2 experts, H 64, I 32) and {logical name: dequantized}."""
    gen = torch.Generator().manual_seed(seed)
    tensors, want = {}, {}
    for name, shape in (("ffn.experts.0.w1", (32, 64)), ("ffn.experts.1.w2", (64, 32)),
                        ("ffn.shared_experts.w1", (32, 64)), ("attn.wq_a", (48, 64))):
        w = torch.randn(*shape, generator=gen)
        if ".experts." in f".{name}" and "shared" not in name:
            q, s = quantize_fp4(w)
            want[f"mtp.0.{name}.weight"] = dequantize_fp4(q, s, torch.float32)
        else:
            q, s = quantize_fp8(w, spec.block, ue8m0=True)
            want[f"mtp.0.{name}.weight"] = dequantize_fp8(q, s, spec.block, torch.float32)
        tensors |= {f"mtp.0.{name}.weight": q, f"mtp.0.{name}.scale": s}
    tensors["mtp.0.ffn.gate.bias"] = want["mtp.0.ffn.gate.bias"] = torch.randn(2, generator=gen)
    return tensors, want


@pytest.mark.parametrize("spec", [V4, V41], ids=["128x128", "32x32"])
def test_quantized_source_reads_the_deepseek_layout_under_logical_names(spec):
    tensors, want = _layout(spec)
    source = QuantizedSource(tensors, spec, torch.float32, transposed_stacked=False)
    assert sorted(source.keys()) == sorted(want)
    kinds = {n: source.stored_kind(n) for n in want}
    assert kinds["mtp.0.ffn.experts.0.w1.weight"] == "fp4" and kinds["mtp.0.ffn.shared_experts.w1.weight"] == "fp8"
    for name, w in want.items():
        assert source.shape(name) == tuple(w.shape)
        assert torch.equal(source.get(name), w), name
    # a slice reads the same numbers as the whole (columns off the 32-groups and the fp8 blocks)
    name = "mtp.0.ffn.experts.1.w2.weight"
    assert torch.equal(source.get(name, (slice(5, 40), slice(3, 29))), want[name][5:40, 3:29])
    assert source.stored_names(name) == (name, "mtp.0.ffn.experts.1.w2.scale")
    assert "1 fp4" not in source.describe() and "2 fp4" in source.describe() and "2 fp8" in source.describe()


def _refusal(tensors, spec=V4):
    with pytest.raises(LoadError) as info:
        source = QuantizedSource(tensors, spec, torch.float32, transposed_stacked=False)
        for name in source.keys():
            source.get(name)
    return str(info.value)


def test_malformed_deepseek_tensors_are_refused_naming_the_tensor():
    tensors, _ = _layout(V4)
    w1, w2, shared = "mtp.0.ffn.experts.0.w1", "mtp.0.ffn.experts.1.w2", "mtp.0.ffn.shared_experts.w1"
    missing = {k: v for k, v in tensors.items() if k != f"{w1}.scale"}
    assert f"{w1}.weight: an fp4 routed expert weight" in _refusal(missing) and "missing scale" in _refusal(missing)
    no_fp8_scale = {k: v for k, v in tensors.items() if k != f"{shared}.scale"}
    assert f"{shared}.weight: torch.float8_e4m3fn weight without its scales" in _refusal(no_fp8_scale)
    bad_shape = tensors | {f"{w1}.scale": tensors[f"{w1}.scale"][:, :1].contiguous()}
    message = _refusal(bad_shape)
    assert f"{w1}.scale: fp4 scales shape [32, 1]" in message and "expected [32, 2]" in message
    bad_fp8_shape = tensors | {f"{shared}.scale": torch.ones(2, 2, dtype=E8M0)}
    assert f"{shared}.scale: fp8 scales shape [2, 2]" in _refusal(bad_fp8_shape)
    narrow = tensors | {f"{w1}.weight": tensors[f"{w1}.weight"][:, :24].contiguous(),
                        f"{w1}.scale": torch.ones(32, 1, dtype=E8M0)}
    assert f"{w1}.weight: fp4 weight has shape [32, 24]" in _refusal(narrow) and "wrong packed width" in _refusal(narrow)
    as_uint8 = tensors | {f"{w2}.weight": tensors[f"{w2}.weight"].view(torch.uint8)}
    assert f"{w2}.weight: fp4 values stored as torch.uint8, expected torch.int8" in _refusal(as_uint8)
    half_scales = tensors | {f"{w2}.scale": tensors[f"{w2}.scale"].float().half()}
    assert f"{w2}.scale: fp4 scales stored as torch.float16" in _refusal(half_scales)
    bf16_weight = tensors | {f"{shared}.weight": tensors[f"{shared}.weight"].bfloat16()}
    assert f"{shared}.weight: fp8 weight stored as torch.bfloat16" in _refusal(bf16_weight)
    int_scale = tensors | {f"{shared}.scale": torch.ones(1, 1, dtype=torch.int32)}
    assert f"{shared}.scale: fp8 scales stored as torch.int32" in _refusal(int_scale)
