"""A DeepSeek-V4 MoE layer built from the released layout's quantized tensors (FP4 routed experts as int8 pairs +
e8m0 `.scale` per 32 inputs, FP8 shared expert + e8m0 `.scale` per block, bf16 router, fp32 gate bias) equals
transformers' `DeepseekV4SparseMoeBlock` run on the same weights dequantized by transformers' own dequantizers.

The layer is handed the checkpoint's raw tensors as a plain dict (as an engine hands them: no wrapping), in
DeepSeek's names (`layers.{i}.ffn.experts.{e}.w1|w2|w3.weight`, `.scale`, `ffn.shared_experts.*`, `ffn.gate.*`),
and is checked both ways it can hold the experts: dequantized at load (CPU's reference path) and kept quantized
in the fused kernels' MXFP4 representation (`StepKernels(quantized_experts=True)`; on CPU the experts then run
the reference loop on that representation's decode, `_dequantized_reference`).
"""

from __future__ import annotations

import pytest
import torch

from epdraft.config.hf import DraftMixFFNSpec
from epdraft.errors import LoadError
from epdraft.layers import build_ffn
from epdraft.layers.step_kernels import StepKernels
from epdraft.loading.quant import quantize_fp4, quantize_fp8
from tests.layers.test_deepseek_v4_moe_vs_transformers import E, H, HASH_LAYER, I, REL_TOL, TOPK_LAYER, V, _config

finegrained_fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
pytest.importorskip("transformers.models.deepseek_v4")


def _quantized_config(block: list[int]) -> dict:
    return _config().to_dict() | {"expert_dtype": "fp4", "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
        "weight_block_size": block}}


def _hf_dequantized(packed_or_fp8: torch.Tensor, scale: torch.Tensor, block: list[int]) -> torch.Tensor:
    """transformers' dequantization: `Fp8Dequantize` for the FP4 experts, `_dequantize_fp8_weight` for FP8
    (it takes the partial edge blocks a 128 x 128 grid leaves on these tiny shapes)."""
    if packed_or_fp8.dtype == torch.int8:
        return finegrained_fp8.Fp8Dequantize(None)._dequantize_one(packed_or_fp8, scale, torch.float32)
    return finegrained_fp8._dequantize_fp8_weight(packed_or_fp8, scale, block, torch.float32)


def _checkpoint_and_block(config, layer: int, block: list[int], seed: int = 5):
    """(raw DeepSeek-layout tensors of `layer`, transformers' block holding their dequantization)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    hf = DeepseekV4SparseMoeBlock(config, layer).eval()
    gen = torch.Generator().manual_seed(seed)
    prefix = f"layers.{layer}.ffn."
    raw: dict[str, torch.Tensor] = {}
    deq = {}

    def quantized(name: str, w: torch.Tensor, fp4: bool) -> torch.Tensor:
        q, s = quantize_fp4(w) if fp4 else quantize_fp8(w, tuple(block), ue8m0=True)
        raw[f"{prefix}{name}.weight"], raw[f"{prefix}{name}.scale"] = q, s
        return _hf_dequantized(q, s, block)

    gate_up, down = torch.empty(E, 2 * I, H), torch.empty(E, H, I)
    for e in range(E):
        gate_up[e, :I] = quantized(f"experts.{e}.w1", torch.randn(I, H, generator=gen) * 0.8, True)
        gate_up[e, I:] = quantized(f"experts.{e}.w3", torch.randn(I, H, generator=gen) * 0.8, True)
        down[e] = quantized(f"experts.{e}.w2", torch.randn(H, I, generator=gen) * 0.2, True)
    deq |= {"experts.gate_up_proj": gate_up, "experts.down_proj": down}
    for ours, theirs, scale in (("w1", "gate_proj", 0.8), ("w3", "up_proj", 0.8), ("w2", "down_proj", 0.2)):
        shape = (H, I) if ours == "w2" else (I, H)
        deq[f"shared_experts.{theirs}.weight"] = quantized(f"shared_experts.{ours}", torch.randn(
            *shape, generator=gen) * scale, False)
    router = (torch.randn(E, H, generator=gen) * 0.3).bfloat16()  # released: the router weight in bf16
    raw[prefix + "gate.weight"], deq["gate.weight"] = router, router.float()
    if hf.is_hash:
        table = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(V)])
        raw[prefix + "gate.tid2eid"] = deq["gate.tid2eid"] = table
    else:
        bias = torch.randn(E, generator=gen) * 0.5  # fp32 selection bias
        raw[prefix + "gate.bias"] = deq["gate.e_score_correction_bias"] = bias
    with torch.no_grad():
        for name, t in hf.state_dict().items():
            t.copy_(deq[name])
    return raw, hf


@pytest.mark.parametrize("held", ["dequantized", "quantized"])
@pytest.mark.parametrize("block", [[128, 128], [32, 32]], ids=["v4-128", "v41-32"])
@pytest.mark.parametrize("layer", [TOPK_LAYER, HASH_LAYER], ids=["topk", "hash"])
def test_fp4_layer_from_raw_quantized_tensors_equals_transformers_block(held, block, layer):
    config = _config()
    raw, hf = _checkpoint_and_block(config, layer, block)
    spec = DraftMixFFNSpec.from_config(_quantized_config(block))
    assert spec.layers[layer].quantization.expert_dtype == "fp4"
    kernels = StepKernels(quantized_experts=True) if held == "quantized" else None
    moe = build_ffn(spec, layer, H, dtype=torch.float32, device="cpu", kernels=kernels)
    assert moe.load_weights(raw) == {n for n in raw if not n.endswith(".scale")}  # a plain dict, as stored
    moe.check_loaded()
    if held == "quantized":  # the fused kernels' MXFP4 storage: DeepSeek's bytes and exponents, no bf16 copy
        w13, w2 = moe.experts.weights()
        assert (w13.format, w13.values.dtype, tuple(w13.values.shape)) == ("mxfp4", torch.uint8, (E, 2 * I, H // 2))
        prefix = f"layers.{layer}.ffn.experts.3."
        assert torch.equal(w13.values[3, :I], raw[prefix + "w1.weight"].view(torch.uint8))
        assert torch.equal(w13.values[3, I:], raw[prefix + "w3.weight"].view(torch.uint8))
        assert torch.equal(w2.scales[3], raw[prefix + "w2.scale"].view(torch.uint8))
    else:
        assert moe.experts.w13.dtype == torch.float32
    gen = torch.Generator().manual_seed(11)
    for T in (37, 0, 3):
        x_TH, ids_T = torch.randn(T, H, generator=gen), torch.randint(0, V, (T,), generator=gen)
        with torch.no_grad():
            hashed = layer == HASH_LAYER
            ref_TH = hf(x_TH[None], ids_T[None])[0] if hashed else hf(x_TH[None])[0]
            y_TH = moe(x_TH, None, ids_T if hashed else None)
        assert y_TH.shape == ref_TH.shape == (T, H)
        if T:
            rel = ((y_TH - ref_TH).norm() / ref_TH.norm()).item()
            assert rel <= REL_TOL, f"T={T}: rel err {rel:.2e}"


def test_raw_quantized_tensors_into_an_unquantized_layer_are_refused():
    config = _config()
    raw, _ = _checkpoint_and_block(config, TOPK_LAYER, [32, 32])
    moe = build_ffn(DraftMixFFNSpec.from_config(config.to_dict()), TOPK_LAYER, H, dtype=torch.float32, device="cpu")
    with pytest.raises(LoadError, match=r"layers\.2\.ffn\..*\.scale: a quantized tensor, but the config has no "
                                        "quantization_config"):
        moe.load_weights(raw)
