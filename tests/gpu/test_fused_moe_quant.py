"""Fused experts on FP8 (128 x 128 block scales) and MXFP4 weights against `experts_reference` on the
dequantized bf16 weights: the four `epdraft bench kernel` shapes, T in {0, 1, 16, 128, 512, 2048}.

The bound is DESIGN.md's bf16 drift (max |dy| <= 0.2 mean|y|, mean <= 0.02 mean|y|). MXFP4 tiles are
exact in bf16, as the reference's dequantization is, through either upcast (`mxfp4_upcast`: the
bits path, `epdraft.kernels.experts.e2m1`, on checkpoint-order or shift-packed bytes, and `tl.dot_scaled`),
and the upcasts agree to accumulation order (the bits path's two decodes bit for bit); FP8 tiles multiply as exact e4m3 values and their block scale is applied to the fp32 partial
product, where the reference rounds fp8 * scale to bf16 first: a difference of at most one bf16
rounding per weight, besides accumulation order. The last tests run the bits path's Triton upcast
alone on every byte and scale, bit for bit (each decode).
"""

from __future__ import annotations

import functools

import pytest
import torch

from epdraft.bench.kernel import SHAPES
from epdraft.config.ffn import ActivationSpec
from epdraft.errors import ConfigError
from epdraft.bench.tune import random_routing
from epdraft.kernels.experts.tables import DownConfig, MoeKernelConfig, UpConfig
from epdraft.layers.experts import experts_reference
from epdraft.loading.quant import dequantize_weights, quantize_weights
from tests.gpu.test_fused_moe import assert_matches

pytestmark = pytest.mark.gpu

TOKENS = (0, 1, 16, 128, 512, 2048)
# (format, mxfp4_upcast or "shift": the bits upcast on shift-packed weights): fp8 ignores the upcast
FORMATS = [("fp8", "bits"), ("mxfp4", "bits"), ("mxfp4", "shift"), ("mxfp4", "dot_scaled")]


def _packed(w13, w2, upcast: str):
    """(w13, w2, the kernels' mxfp4_upcast) for a FORMATS upcast name."""
    if upcast == "shift":
        return w13.shift_packed(), w2.shift_packed(), "bits"
    return w13, w2, upcast


@functools.lru_cache(maxsize=1)
def _weights(shape: str, fmt: str):
    """(quantized w13, w2, their bf16 dequantization) of one bench shape; one shape held at a time."""
    E, I, H, _ = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(5)
    w13 = quantize_weights(torch.randn(E, 2 * I, H, device="cuda", generator=gen) * H**-0.5, fmt)
    w2 = quantize_weights(torch.randn(E, H, I, device="cuda", generator=gen) * I**-0.5, fmt)
    return w13, w2, dequantize_weights(w13, torch.bfloat16), dequantize_weights(w2, torch.bfloat16)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt, upcast", FORMATS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_quantized_experts_match_the_dequantized_reference(shape, fmt, upcast):
    from epdraft.kernels.experts.fused import fused_experts_quantized

    E, I, H, K = SHAPES[shape]
    w13, w2, ref13, ref2 = _weights(shape, fmt)
    w13, w2, upcast = _packed(w13, w2, upcast)
    failures = []
    for num_tokens in TOKENS:
        gen = torch.Generator(device="cuda").manual_seed(num_tokens)
        x = torch.randn(num_tokens, H, device="cuda", generator=gen).to(torch.bfloat16)
        ids, weights = random_routing(num_tokens, E, K, torch.device("cuda"), gen)
        out = fused_experts_quantized(x, ids, weights, w13, w2, ActivationSpec(), mxfp4_upcast=upcast)
        try:
            assert_matches(out, experts_reference(x, ids, weights, ref13, ref2, ActivationSpec()))
        except AssertionError as e:
            failures.append(f"T={num_tokens}: {e}")
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("fmt, upcast", FORMATS)
@pytest.mark.parametrize("up_split, down_split, block_m, weight_tma",
                         [(1, 1, 16, False), (2, 4, 16, False), (1, 2, 64, False), (1, 1, 16, True), (2, 2, 32, True)])
def test_quantized_split_k_bias_and_clamp(fmt, upcast, up_split, down_split, block_m, weight_tma):
    """Split-K partials, expert biases, the swigluoai clamp and dropped (-1) pairs on quantized
    weights, with per-thread and TMA weight loads (dot_scaled keeps per-thread loads)."""
    from epdraft.kernels.experts.fused import fused_experts_with_config

    E, I, H, K = 8, 512, 1024, 4
    gen = torch.Generator(device="cuda").manual_seed(7)
    w13 = quantize_weights(torch.randn(E, 2 * I, H, device="cuda", generator=gen) * H**-0.5, fmt)
    w2 = quantize_weights(torch.randn(E, H, I, device="cuda", generator=gen) * I**-0.5, fmt)
    b13 = (torch.randn(E, 2 * I, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
    b2 = (torch.randn(E, H, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
    x = torch.randn(300, H, device="cuda", generator=gen).to(torch.bfloat16)
    ids, weights = random_routing(300, E, K, torch.device("cuda"), gen)
    ids[::7, 1] = -1
    act = ActivationSpec(kind="swigluoai", limit=7.0)
    ref13, ref2 = dequantize_weights(w13, torch.bfloat16), dequantize_weights(w2, torch.bfloat16)
    w13, w2, upcast = _packed(w13, w2, upcast)
    config = MoeKernelConfig(block_m=block_m, up=UpConfig(block_n=64, block_k=128, split_k=up_split, weight_tma=weight_tma),
                             down=DownConfig(block_n=64, block_k=64, split_k=down_split, weight_tma=weight_tma))
    out = fused_experts_with_config(x, ids, weights, w13, w2, act, b13, b2, config, upcast)
    ref = experts_reference(x, ids, weights, ref13, ref2, act, b13, b2)
    assert_matches(out, ref)


def test_mxfp4_upcasts_agree_and_take_any_activation_layout():
    """Both upcasts on the same weights agree to accumulation order, and the bits path's two decodes
    bit for bit; the bits path (which reads x's K-column pairs as int32) takes a strided,
    2-byte-offset x by copying it; dot_scaled refuses shift-packed bytes."""
    from epdraft.kernels.experts.fused import fused_experts_quantized

    gen = torch.Generator(device="cuda").manual_seed(9)
    w13 = quantize_weights(torch.randn(8, 512, 512, device="cuda", generator=gen) * 512**-0.5, "mxfp4")
    w2 = quantize_weights(torch.randn(8, 512, 256, device="cuda", generator=gen) * 256**-0.5, "mxfp4")
    wide = torch.randn(100, 513, device="cuda", generator=gen).to(torch.bfloat16)
    x = wide[:, 1:]  # row stride 513 (odd), base 2 bytes past an alignment
    ids, weights = random_routing(100, 8, 2, torch.device("cuda"), gen)
    bits = fused_experts_quantized(x, ids, weights, w13, w2, ActivationSpec(), mxfp4_upcast="bits")
    dot_scaled = fused_experts_quantized(x.contiguous(), ids, weights, w13, w2, ActivationSpec(),
                                         mxfp4_upcast="dot_scaled")
    assert_matches(bits, dot_scaled)
    # the same bf16 products summed in another order: a rare last-bit flip of an h or y rounding
    assert (bits.float() - dot_scaled.float()).abs().mean() <= 1e-3 * dot_scaled.float().abs().mean()
    s13, s2 = w13.shift_packed(), w2.shift_packed()
    assert s13.packing == s2.packing == "shift"
    assert torch.equal(fused_experts_quantized(x, ids, weights, s13, s2, ActivationSpec(), mxfp4_upcast="bits"), bits)
    with pytest.raises(ConfigError, match="shift packed"):
        fused_experts_quantized(x, ids, weights, s13, s2, ActivationSpec(), mxfp4_upcast="dot_scaled")
    with pytest.raises(ConfigError, match="mxfp4_upcast = 'fast'; expected one of"):
        fused_experts_quantized(x, ids, weights, w13, w2, ActivationSpec(), mxfp4_upcast="fast")


def test_bits_upcast_is_the_reference_for_every_byte_and_scale():
    """Every byte x every e8m0 scale on the device: bit for bit the reference for 2 <= e <= 254; e = 1
    exact or flushed to zero where the result is subnormal; e = 0 zeros, e = 255 infinities or NaN
    (epdraft.kernels.experts.e2m1 says why)."""
    from epdraft.loading.quant import dequantize_mxfp4
    from tests.gpu._upcast_kernel import upcast

    byte = torch.arange(256, dtype=torch.uint8, device="cuda").repeat(256)  # [65536]: 256 scales x 256 bytes
    e = torch.arange(256, dtype=torch.uint8, device="cuda").repeat_interleave(256)
    lo, hi = upcast(byte, e)
    got = torch.stack((lo, hi), dim=-1).view(256, 512).view(torch.int16)  # [scale, element 2j / 2j+1]
    ref = dequantize_mxfp4(byte.view(256, 16, 16), e.view(256, 256)[:, ::16], torch.bfloat16).view(torch.int16)
    assert torch.equal(got[2:255], ref[2:255])
    flushed = (got[1] != ref[1])
    assert (got[1][flushed] == 0).all() and (ref[1][flushed].view(torch.bfloat16).abs() < 2**-126).all()
    assert (got[0].view(torch.bfloat16) == 0).all()
    assert (got[255].view(torch.bfloat16).isinf() | got[255].view(torch.bfloat16).isnan()).all()


def test_shift_upcast_is_the_reference_for_every_byte_and_scale_it_takes():
    """The shift decode on every byte x every e8m0 scale up to 128, bit for bit the reference, e = 0
    and 1 included: its unscaled values are bf16 subnormals (0.5 * 2**-126), so this also says the
    device's bf16 multiply keeps subnormal inputs and results."""
    from epdraft.kernels.experts.e2m1 import SHIFT_MAX_SCALE, shift_pack
    from epdraft.loading.quant import dequantize_mxfp4
    from tests.gpu._upcast_kernel import upcast

    byte = torch.arange(256, dtype=torch.uint8, device="cuda").repeat(256)  # a scale per 256 bytes
    e = torch.arange(256, device="cuda").clamp(max=SHIFT_MAX_SCALE).to(torch.uint8).repeat_interleave(256)
    lo, hi = upcast(shift_pack(byte.view(1, -1)).view(-1), e, shift=True)
    got = torch.stack((lo, hi), dim=-1).view(256, 512).view(torch.int16)
    ref = dequantize_mxfp4(byte.view(256, 16, 16), e.view(256, 256)[:, ::16], torch.bfloat16).view(torch.int16)
    assert torch.equal(got, ref)


def test_fp8_upcast_is_the_conversion_for_every_byte():
    """The kernels' integer e4m3 -> bf16 (epdraft.kernels.experts.e4m3) on the device, every byte in every
    position of a 4-byte word: torch's conversion bit for bit (subnormals included), NaN read as +-480."""
    from tests.gpu._upcast_kernel import upcast_e4m3

    codes = torch.arange(256, dtype=torch.uint8, device="cuda")
    words = torch.stack([codes.roll(shift) for shift in range(16)]).flatten()  # 4096 bytes
    got = upcast_e4m3(words.view(torch.float8_e4m3fn))
    ref = words.view(torch.float8_e4m3fn).to(torch.bfloat16)
    nan = ref.isnan()
    assert torch.equal(got[~nan].view(torch.int16), ref[~nan].view(torch.int16))
    assert (got[nan].abs() == 480).all()


def test_quantized_refusals_name_the_tensor():
    from epdraft.kernels.experts.fused import fused_experts_quantized

    gen = torch.Generator(device="cuda").manual_seed(8)
    w13 = quantize_weights(torch.randn(4, 256, 256, device="cuda", generator=gen), "mxfp4")
    w2 = quantize_weights(torch.randn(4, 256, 128, device="cuda", generator=gen), "fp8")
    x = torch.randn(3, 256, device="cuda").to(torch.bfloat16)
    ids, weights = random_routing(3, 4, 2, torch.device("cuda"), gen)
    with pytest.raises(ConfigError, match="w13 is mxfp4, w2 fp8"):
        fused_experts_quantized(x, ids, weights, w13, w2, ActivationSpec())
    w2 = quantize_weights(torch.randn(4, 256, 128, device="cuda", generator=gen), "mxfp4")
    with pytest.raises(ConfigError, match="needs? bf16 activations"):
        fused_experts_quantized(x.half(), ids, weights, w13, w2, ActivationSpec())


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_draft_moe_keeps_quantized_experts_on_cuda(fmt):
    """A DraftMoE built on CUDA in bf16 from a quantized checkpoint holds the stored blocks and runs the
    quantized kernels; its output matches the same layer holding the dequantized weights, and for
    mxfp4 stays bit for bit the same once `pack_for_kernels` re-lays the blocks for the shift decode."""
    import msgspec

    from epdraft.config.ffn import DraftMoeFFNSpec, RouterSpec
    from epdraft.config.quant import QuantSpec
    from epdraft.layers import DraftMoE
    from epdraft.loading import QuantizedSource, load_ffn
    from epdraft.loading.quant import quantize_fp8, quantize_mxfp4

    E, I, H = 16, 256, 512
    quant = QuantSpec(method=fmt, block=(128, 128) if fmt == "fp8" else (1, 32), not_converted=("mlp.gate",))
    spec = DraftMoeFFNSpec(router=RouterSpec(num_experts=E, top_k=4), intermediate_size=I, quantization=quant)
    gen = torch.Generator().manual_seed(11)
    tensors = {"layers.0.mlp.gate.weight": torch.randn(E, H, generator=gen)}
    for e in range(E):
        for part, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            name = f"layers.0.mlp.experts.{e}.{part}_proj.weight"
            w = torch.randn(*shape, generator=gen) * shape[1] ** -0.5
            if fmt == "mxfp4":
                blocks, scales = quantize_mxfp4(w)
                tensors |= {name + "_blocks": blocks, name + "_scales": scales}
            else:
                q, scale = quantize_fp8(w, (128, 128))
                tensors |= {name: q, name + "_scale_inv": scale}
    held = DraftMoE(spec, H, layer_id=0, dtype=torch.bfloat16, device="cuda")
    plain = DraftMoE(msgspec.structs.replace(spec, quantization=None), H, layer_id=0, dtype=torch.bfloat16,
                     device="cuda")
    for module in (held, plain):
        load_ffn(module, QuantizedSource(tensors, quant, torch.bfloat16, transposed_stacked=False), 0)
    assert held.experts.quantization == quant and plain.experts.quantization is None
    x = torch.randn(64, H, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        out = held(x)
        assert_matches(out, plain(x))
        held.experts.pack_for_kernels()
        packed = (held.experts.w13_packing, held.experts.w2_packing)
        assert packed == (("shift", "shift") if fmt == "mxfp4" else ("nibbles", "nibbles"))
        assert torch.equal(held(x), out)
        # a reload into re-laid experts lands in checkpoint order and is re-laid again
        held.load_weights(QuantizedSource(tensors, quant, torch.bfloat16, transposed_stacked=False))
        assert (held.experts.w13_packing, held.experts.w2_packing) == packed
        assert torch.equal(held(x), out)


def test_fp8_experts_holding_a_nan_are_refused_naming_the_module():
    """The kernels' e4m3 decode reads NaN codes as +-480, which the step's NaN guard never sees, so
    `pack_for_kernels` refuses FP8 experts holding one, naming the module and the tensor."""
    from epdraft.config.ffn import ActivationSpec
    from epdraft.config.quant import QuantSpec
    from epdraft.errors import LoadError
    from epdraft.layers.routed_experts import RoutedExperts
    from epdraft.loading import ExpertShard

    shard = ExpertShard(num_experts=2, intermediate_size=128, hidden_size=128)
    experts = RoutedExperts(shard, ActivationSpec(), dtype=torch.bfloat16, device="cuda",
                            quantization=QuantSpec(method="fp8", block=(128, 128)))
    experts.w13.data.view(torch.uint8).fill_(0x38)  # 1.0
    experts.w2.data.view(torch.uint8).fill_(0x38)
    experts.pack_for_kernels("layers.1.mlp.experts")  # finite: accepted
    experts.w2.data.view(torch.uint8)[1, 5, 7] = 0xFF
    with pytest.raises(LoadError, match=r"layers\.1\.mlp\.experts\.w2 \(down\): 1 of 32768 FP8 e4m3 values are NaN"):
        experts.pack_for_kernels("layers.1.mlp.experts")


def test_deepseek_fp4_experts_run_in_the_fused_kernels_without_a_bf16_copy():
    """DeepSeek's released storage (FP4 routed experts as int8 pairs + e8m0 `.scale`, FP8 shared expert + e8m0
    `.scale` per 128 x 128, handed to `load_weights` raw): on CUDA in bf16 the experts are held as the kernels'
    mxfp4 (uint8 bytes, the stored ones) and match the same layer holding the dequantized weights."""
    import msgspec

    from epdraft.config.ffn import DraftMoeFFNSpec, RouterSpec
    from epdraft.config.quant import QuantSpec
    from epdraft.layers import DraftMoE
    from epdraft.loading.quant import quantize_fp4, quantize_fp8

    E, I, H = 16, 256, 512
    quant = QuantSpec(method="fp8", block=(128, 128), scale_fmt="ue8m0", expert_dtype="fp4")
    spec = DraftMoeFFNSpec(router=RouterSpec(num_experts=E, top_k=4), intermediate_size=I, shared_intermediate_size=I,
                           quantization=quant)
    gen = torch.Generator().manual_seed(12)
    raw = {"layers.0.ffn.gate.weight": torch.randn(E, H, generator=gen).bfloat16()}
    for name, shape, fp4 in [*((f"experts.{e}.w{k}", (H, I) if k == 2 else (I, H), True)
                               for e in range(E) for k in (1, 2, 3)),
                             *((f"shared_experts.w{k}", (H, I) if k == 2 else (I, H), False) for k in (1, 2, 3))]:
        w = torch.randn(*shape, generator=gen) * shape[1] ** -0.5
        q, scale = quantize_fp4(w) if fp4 else quantize_fp8(w, (128, 128), ue8m0=True)
        raw |= {f"layers.0.ffn.{name}.weight": q, f"layers.0.ffn.{name}.scale": scale}
    held = DraftMoE(spec, H, layer_id=0, dtype=torch.bfloat16, device="cuda")
    assert held.kernels.quantized_experts, held.kernels.label
    plain = DraftMoE(msgspec.structs.replace(spec, quantization=None), H, layer_id=0, dtype=torch.bfloat16,
                     device="cuda", quantization=quant)
    for module in (held, plain):
        module.load_weights(raw)
        module.check_loaded()
    assert held.experts.w13.dtype == torch.uint8 and held.experts.w13.shape == (E, 2 * I, H // 2)
    assert torch.equal(held.experts.w13[5, :I].cpu(), raw["layers.0.ffn.experts.5.w1.weight"].view(torch.uint8))
    assert plain.experts.w13.dtype == torch.bfloat16
    x = torch.randn(64, H, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        out = held(x)
        assert_matches(out, plain(x))
        held.experts.pack_for_kernels()
        assert (held.experts.w13_packing, held.experts.w2_packing) == ("shift", "shift")
        assert torch.equal(held(x), out)
