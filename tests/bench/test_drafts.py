"""`bench step --weights bf16,quantized`'s second draft on CPU: a tiny DeepSeek DSpark draft's quantized twin
holds what the loader holds of the same weights in DeepSeek's released layout, its floor counts the bytes
its step reads (FP4 experts: e2m1 pairs + e8m0 scales; the FP8 linears as held, dequantized), and the
released floor counts those linears at one byte a weight plus their e8m0 block scales."""

from __future__ import annotations

import pytest
import torch

from epdraft.bench.drafts import (FP8_LINEAR, plain_config, quantized_twin, random_draft, release_block,
                                  release_config, released_bytes)  # fmt: skip
from epdraft.bench.step import RandomHeads, floor_seconds, touched_experts
from epdraft.errors import ConfigError
from epdraft.layers.step_kernels import StepKernels
from epdraft.loading import DictSource, quantized_source
from epdraft.loading.quant import quantize_fp4, quantize_fp8
from epdraft.models.checkpoint import load_draft_weights
from epdraft.models.deepseek_names import to_export_state_dict
from epdraft.models.protocol import DRAFT_FAMILIES
from epdraft.models.spec import DraftModelSpec

H, V, I, E, L, W = 64, 50, 32, 4, 2, 8
RATE = 3.0e12
HELD = StepKernels(quantized_experts=True)  # CPU: experts held FP4 (the reference loop runs their dequantization)


def tiny_v41() -> dict:
    return {
        "architectures": ["DSparkV4DraftModel"], "model_type": "deepseek_v4_dspark_draft", "block_size": 5,
        "dflash_config": {"attention_mode": "deepseek_v41", "context_window": W, "confidence_head_with_markov": True,
                          "enable_confidence_head": True, "kv_fake_quant": True, "markov_head_type": "vanilla",
                          "markov_rank": 8, "mask_token_id": V - 1, "projector_type": "dspark_v4",
                          "target_layer_ids": [0, 1]},
        "hidden_size": H, "vocab_size": V, "num_hidden_layers": L, "rms_norm_eps": 1e-6, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 16, "qk_rope_head_dim": 4, "q_lora_rank": 8, "o_lora_rank": 8,
        "o_groups": 2, "rope_theta": 10000.0, "n_routed_experts": E, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "moe_intermediate_size": I, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    }  # fmt: skip


def drafts():
    torch.manual_seed(0)
    plain = random_draft(DraftModelSpec.from_config(tiny_v41()), dtype=torch.float32, device="cpu")
    spec = DraftModelSpec.from_config(release_config(tiny_v41(), release_block(plain.spec)))
    return plain, spec, quantized_twin(plain, spec, kernels=HELD)


_EXPORT_FP8 = r"mtp\.\d+\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.w[123]|main_proj)\.weight"
_EXPORT_FP4 = r"mtp\.\d+\.ffn\.experts\.\d+\.w[123]\.weight"


@torch.no_grad()
def test_the_twin_holds_what_the_loader_holds_of_the_release():
    import re

    plain, spec, twin = drafts()
    assert release_block(plain.spec) == 32 and spec.ffn.quantization.block == (32, 32)
    released = {}  # the plain draft written in DeepSeek's released storage, as the tools write it
    for name, t in to_export_state_dict(plain, L).items():
        if re.fullmatch(_EXPORT_FP8, name) or re.fullmatch(_EXPORT_FP4, name):
            q, s = quantize_fp4(t) if re.fullmatch(_EXPORT_FP4, name) else quantize_fp8(t, (32, 32), ue8m0=True)
            released[name], released[name.removesuffix(".weight") + ".scale"] = q, s
        else:
            released[name] = t
    loaded = DRAFT_FAMILIES[spec.kind](spec, dtype=torch.float32, device="cpu", dispatcher=None, kernels=HELD)
    load_draft_weights(loaded, quantized_source(DictSource(released), spec.ffn, torch.float32))
    ours, theirs = twin.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name
    w13 = twin.layers[0].mlp.experts.w13
    assert w13.dtype == torch.uint8 and w13.shape == (E, 2 * I, H // 2)
    assert not torch.equal(twin.layers[0].attn.q_b_proj.weight, plain.layers[0].attn.q_b_proj.weight)  # FP8-rounded


@torch.no_grad()
def test_floor_counts_the_bytes_the_quantized_step_reads():
    plain, spec, twin = drafts()
    heads = RandomHeads(V, H, dtype=torch.float32, device=torch.device("cpu"))
    pool = twin.new_pool(max_requests=2, max_context=16)
    for rid in range(2):
        pool.admit(rid)
    touched = touched_experts(twin, lambda: twin.step(pool, torch.arange(2), torch.tensor([3, 5]), heads, None))
    n, context = 2, 16
    _, nbytes, flops = floor_seconds(twin, heads, n, context, RATE, touched)
    per_expert = 3 * I * H // 2 + 3 * I * H // 32  # e2m1 pairs + one e8m0 byte per 32 weights, gate/up and down
    non_expert = sum(p.numel() * 4 for name, p in twin.named_parameters()
                     if ".experts." not in name and not name.startswith("main_proj."))  # fmt: skip
    # the window's one K=V row of head_dim 16, fp32, read, and the block's 5 written
    context_rows = L * n * (W + spec.block_size) * 16 * 4
    assert nbytes == non_expert + sum(touched) * per_expert + context_rows + V * H * 4
    _, plain_bytes, plain_flops = floor_seconds(plain, heads, n, context, RATE, touched)
    assert plain_bytes - nbytes == sum(touched) * (3 * I * H * 4 - per_expert)
    assert plain_flops == flops  # FLOPs from the logical shapes, whatever the storage

    _, released, _ = floor_seconds(twin, heads, n, context, RATE, touched, released_bytes(32))
    fp8 = [(name, p) for name, p in twin.named_parameters()
           if FP8_LINEAR.fullmatch(name) and not name.startswith("main_proj.")]  # fmt: skip
    assert len(fp8) == L * 8  # q_a, q_b, kv, o_a, o_b, shared gate / up / down
    held = sum(p.numel() * 4 for _, p in fp8)
    as_released = sum(p.numel() + -(-p.shape[0] // 32) * -(-p.shape[1] // 32) for _, p in fp8)
    assert nbytes - released == held - as_released


def test_plain_config_and_what_the_twin_refuses():
    config = release_config(tiny_v41(), 32)
    assert config["quantization_config"]["weight_block_size"] == [32, 32] and config["expert_dtype"] == "fp4"
    assert plain_config(config) == tiny_v41()
    plain = random_draft(DraftModelSpec.from_config(tiny_v41()), dtype=torch.float32, device="cpu")
    with pytest.raises(ConfigError, match="released DSpark layout"):
        quantized_twin(plain, plain.spec)
