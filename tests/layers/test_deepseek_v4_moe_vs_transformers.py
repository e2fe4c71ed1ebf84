"""epdraft's DeepSeek-V4 MoE layer equals transformers' own `DeepseekV4SparseMoeBlock` (fp32, CPU).

The layer is built the way a draft builds it: `DraftMixFFNSpec.from_config` on a tiny `DeepseekV4Config`
(H 64, 8 routed experts, top-2, moe_intermediate 32, 1 shared expert, sqrtsoftplus, routed_scaling_factor 1.5,
swiglu_limit 10; layer 0 hash-routed, layers 1-3 top-k), then `build_ffn(spec, i, H)` and `load_weights` fed
transformers' own `state_dict` names unmapped (`gate.weight`, `gate.e_score_correction_bias` / `gate.tid2eid`,
fused `experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`, `shared_experts.{gate,up,down}_proj`).
Random weights: a selection bias that changes the chosen experts on some tokens, and expert / shared weights large
enough that the SwiGLU clamp (gate <= 10, up in [-10, 10]) is hit.

Compared on the same 37 tokens (and a few other counts, 0 included): the selected expert sets (exactly), the
combine weights (rtol 1e-5, atol 1e-6) and the layer output within DESIGN.md's fp32 tolerance, 1e-5 relative
(||y - y_hf|| / ||y_hf||, and also max |dy| / max |y_hf|).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from epdraft.config.hf import DraftMixFFNSpec
from epdraft.layers import build_ffn

pytest.importorskip("transformers.models.deepseek_v4")

H, V, E, K, I = 64, 97, 8, 2, 32
LIMIT = 10.0
HASH_LAYER, TOPK_LAYER = 0, 2
REL_TOL = 1e-5
TOKENS = (37, 0, 1, 5)


def _config():
    from transformers import DeepseekV4Config

    config = DeepseekV4Config(
        hidden_size=H, vocab_size=V, num_hidden_layers=4, num_hash_layers=1,
        n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=I, n_shared_experts=1,
        scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=LIMIT,
    )  # fmt: skip
    config._experts_implementation = "eager"  # the reference loop, not grouped_mm
    return config


def _hf_block(config, layer: int, seed: int = 3):
    """transformers' block for `layer` with random weights: router N(0, 0.3), bias N(0, 0.5), experts and shared
    gate/up N(0, 0.8) (so |gate·x|, |up·x| pass 10 on some rows), down N(0, 0.2); tid2eid K distinct experts."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    block = DeepseekV4SparseMoeBlock(config, layer).eval()
    gen = torch.Generator().manual_seed(seed)
    scale = {"gate.weight": 0.3, "gate.e_score_correction_bias": 0.5, "experts.gate_up_proj": 0.8,
             "experts.down_proj": 0.2, "shared_experts.gate_proj.weight": 0.8,
             "shared_experts.up_proj.weight": 0.8, "shared_experts.down_proj.weight": 0.2}  # fmt: skip
    with torch.no_grad():
        for name, t in block.state_dict().items():
            if name == "gate.tid2eid":
                t.copy_(torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(V)]))
            else:
                t.copy_(torch.randn(t.shape, generator=gen) * scale[name])
    return block


def _draft_layer(config, layer: int, block):
    spec = DraftMixFFNSpec.from_config(config.to_dict())
    moe = build_ffn(spec, layer, H, dtype=torch.float32, device="cpu")
    state = {f"model.layers.{layer}.mlp.{k}": v for k, v in block.state_dict().items()}
    assert moe.load_weights(state) == set(state)
    moe.check_loaded()
    return moe


def _sets(ids_TK):
    return ids_TK.sort(dim=-1).values


def _compare(moe, block, x_TH, ids_T, hashed: bool):
    """(output rel err by norm, by max, weights max abs err) after asserting the expert sets are identical."""
    with torch.no_grad():
        if hashed:
            _, hf_w_TK, hf_ids_TK = block.gate(x_TH[None], ids_T[None])
            ref_TH = block(x_TH[None], ids_T[None])[0]
        else:
            _, hf_w_TK, hf_ids_TK = block.gate(x_TH[None])
            ref_TH = block(x_TH[None])[0]
        ids_TK, w_TK = moe.router(x_TH, ids_T if hashed else None)
        y_TH = moe(x_TH, None, ids_T if hashed else None)
    assert y_TH.shape == ref_TH.shape == (x_TH.shape[0], H) and y_TH.dtype == torch.float32
    # transformers selects with sorted=False, epdraft sorted: compare each token's set, weights in the same order.
    order_hf, order = hf_ids_TK.argsort(-1), ids_TK.argsort(-1)
    assert torch.equal(_sets(ids_TK), _sets(hf_ids_TK)), "selected experts differ"
    if x_TH.shape[0] == 0:
        return 0.0, 0.0, 0.0
    w, hf_w = w_TK.gather(1, order), hf_w_TK.gather(1, order_hf)
    torch.testing.assert_close(w, hf_w, rtol=1e-5, atol=1e-6)
    rel = ((y_TH - ref_TH).norm() / ref_TH.norm()).item()
    rel_max = ((y_TH - ref_TH).abs().max() / ref_TH.abs().max()).item()
    return rel, rel_max, (w - hf_w).abs().max().item()


@pytest.mark.parametrize("layer", [TOPK_LAYER, HASH_LAYER], ids=["topk", "hash"])
def test_deepseek_v4_moe_layer_equals_transformers_block(layer):
    config = _config()
    assert config.mlp_layer_types[layer] == ("hash_moe" if layer == HASH_LAYER else "moe")
    block = _hf_block(config, layer)
    assert block.is_hash == (layer == HASH_LAYER)
    moe = _draft_layer(config, layer, block)
    r = moe.spec.router
    assert (r.num_experts, r.top_k, r.scoring, r.routed_scaling_factor, r.hash_routed) == (
        E, K, "sqrtsoftplus", 1.5, layer == HASH_LAYER)
    assert r.norm_topk_prob and r.renorm_eps == 1e-20 and moe.spec.activation.limit == LIMIT
    assert r.bias == ("none" if layer == HASH_LAYER else "selection")
    gen = torch.Generator().manual_seed(11)
    for T in TOKENS:
        x_TH, ids_T = torch.randn(T, H, generator=gen), torch.randint(0, V, (T,), generator=gen)
        rel, rel_max, dw = _compare(moe, block, x_TH, ids_T, hashed=layer == HASH_LAYER)
        assert rel <= REL_TOL and rel_max <= REL_TOL, f"T={T}: rel err {rel:.2e} (max-norm {rel_max:.2e}), dw {dw:.1e}"
        if T == TOKENS[0]:
            x37_TH = x_TH
    # The case is only meaningful if the clamp was hit (routed and shared, gate and up) and, for the top-k
    # layer, the selection bias changed the chosen experts on some but not all tokens.
    with torch.no_grad():
        gate_up = torch.einsum("th,eih->tei", x37_TH, block.experts.gate_up_proj)
        shared_g, shared_u = block.shared_experts.gate_proj(x37_TH), block.shared_experts.up_proj(x37_TH)
    assert (gate_up[..., :I] > LIMIT).any() and (gate_up[..., I:].abs() > LIMIT).any()
    assert (shared_g > LIMIT).any() and (shared_u.abs() > LIMIT).any()
    if layer == TOPK_LAYER:
        scores_TE = F.softplus(x37_TH @ block.gate.weight.detach().T).sqrt()
        unbiased = _sets(scores_TE.topk(K, dim=-1).indices)
        biased = _sets(moe.router(x37_TH)[0])
        changed = (unbiased != biased).any(-1)
        assert 0 < int(changed.sum()) < len(changed), int(changed.sum())
