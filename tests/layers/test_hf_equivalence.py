"""DraftMoE equals HF transformers' MoE blocks (fp32, CPU) after loading their state_dict through epdraft.loading."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, GptOssConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from epdraft.config.ffn import ActivationSpec, DraftMoeFFNSpec, RouterSpec
from epdraft.config.hf import DraftMixFFNSpec
from epdraft.layers import DraftMoE, build_ffn
from epdraft.loading import load_ffn

H = 32
TOKENS = (0, 1, 5, 64)
REL_TOL = 1e-5


def _randomize(block: torch.nn.Module, seed: int) -> None:
    """HF leaves most block tensors uninitialised; fill every parameter and buffer with N(0, 0.2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*block.parameters(), *block.buffers()]:
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.2)


def _eager(config):
    config._experts_implementation = "eager"
    return config


def _qwen3(norm: bool):
    config = _eager(
        Qwen3MoeConfig(
            hidden_size=H, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm
        )
    )
    spec = DraftMoeFFNSpec(router=RouterSpec(num_experts=8, top_k=2, norm_topk_prob=norm), intermediate_size=16)
    return Qwen3MoeSparseMoeBlock(config), spec


def _qwen2():
    config = _eager(
        Qwen2MoeConfig(
            hidden_size=H, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
        )
    )
    spec = DraftMoeFFNSpec(
        router=RouterSpec(num_experts=8, top_k=3, norm_topk_prob=False),
        intermediate_size=16, shared_intermediate_size=24, shared_gate=True,
    )
    return Qwen2MoeSparseMoeBlock(config), spec


def _mixtral():
    config = _eager(MixtralConfig(hidden_size=H, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2))
    spec = DraftMoeFFNSpec(router=RouterSpec(num_experts=8, top_k=2), intermediate_size=16)
    return MixtralSparseMoeBlock(config), spec


def _deepseek_v3():
    config = _eager(
        DeepseekV3Config(
            hidden_size=H, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
            n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1,
        )
    )
    router = RouterSpec(
        num_experts=16, top_k=4, scoring="sigmoid", renorm_eps=1e-20, routed_scaling_factor=2.5,
        n_group=4, topk_group=2, bias="selection",
    )
    return DeepseekV3MoE(config), DraftMoeFFNSpec(router=router, intermediate_size=16, shared_intermediate_size=16)


def _gpt_oss():
    config = _eager(GptOssConfig(hidden_size=H, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2))
    spec = DraftMoeFFNSpec(
        router=RouterSpec(num_experts=8, top_k=2, scoring="softmax_topk", bias="logit"),
        intermediate_size=24,
        activation=ActivationSpec(kind="swigluoai", limit=7.0, alpha=1.702),
        expert_bias=True,
    )
    return GptOssMLP(config), spec


CASES = {
    "qwen3_moe": lambda: _qwen3(True),
    "qwen3_moe_no_norm": lambda: _qwen3(False),
    "qwen2_moe_shared_gate": _qwen2,
    "mixtral": _mixtral,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
}


def _hf_route(block, x_TH):
    router = block.router if hasattr(block, "router") else block.gate
    _, weights_TK, ids_TK = router(x_TH)
    return ids_TK, weights_TK.float()


def _sorted(ids_TK, weights_TK):
    ids_sorted, order = ids_TK.sort(dim=-1)
    return ids_sorted, weights_TK.gather(1, order)


def _rel_err(y, ref):
    return ((y - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("case", list(CASES))
def test_draft_moe_equals_hf_block(case):
    torch.manual_seed(0)
    block, spec = CASES[case]()
    block.eval()
    _randomize(block, seed=1)
    if case == "deepseek_v3":
        assert block.gate.e_score_correction_bias.abs().min() > 0
    mix = DraftMixFFNSpec(family=case, hidden_size=H, layers=(spec,))
    moe = build_ffn(mix, 0, H, dtype=torch.float32, device="cpu")
    assert isinstance(moe, DraftMoE)
    consumed = load_ffn(moe, block.state_dict(), layer_id=0)
    assert consumed == set(block.state_dict())

    for T in TOKENS:
        x_TH = torch.randn(T, H) * 2.0
        with torch.no_grad():
            ref = block(x_TH.unsqueeze(0))
            ref_TH = (ref[0] if isinstance(ref, tuple) else ref).reshape(T, H)
            y_TH = moe(x_TH)
            ids_TK, weights_TK = moe.router(x_TH)
            hf_ids_TK, hf_weights_TK = _hf_route(block, x_TH)
        assert y_TH.shape == (T, H)
        ids, w = _sorted(ids_TK, weights_TK)
        hf_ids, hf_w = _sorted(hf_ids_TK, hf_weights_TK)
        assert torch.equal(ids, hf_ids), f"{case} T={T}: top-k sets differ"
        if T:
            torch.testing.assert_close(w, hf_w, rtol=1e-5, atol=1e-6)
            assert _rel_err(y_TH, ref_TH) <= REL_TOL, f"{case} T={T}: rel err {_rel_err(y_TH, ref_TH):.2e}"


def _deepseek_v4_reference(x_TH, w):
    """DeepSeek-V4 MoE from its formula: sqrt(softplus) scores, selection-only bias, always renorm (+1e-20),
    x1.5, SwiGLU with gate clamped to <= 10 and up to [-10, 10], ungated shared expert with the same clamp."""

    def swiglu(x, gate, up, down):
        g = (x @ gate.T).clamp(max=10.0)
        u = (x @ up.T).clamp(-10.0, 10.0)
        return (F.silu(g) * u) @ down.T

    scores_TE = F.softplus(x_TH @ w["gate.weight"].T).sqrt()
    ids_TK = (scores_TE + w["gate.bias"]).topk(4, dim=-1).indices
    weights_TK = scores_TE.gather(1, ids_TK)
    weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20) * 1.5
    y_TH = torch.zeros_like(x_TH)
    for t in range(x_TH.shape[0]):
        for j in range(4):
            e = int(ids_TK[t, j])
            expert = [w[f"experts.{e}.{p}.weight"] for p in ("w1", "w3", "w2")]
            y_TH[t] += weights_TK[t, j] * swiglu(x_TH[t : t + 1], *expert)[0]
    shared = [w[f"shared_experts.{p}.weight"] for p in ("w1", "w3", "w2")]
    return y_TH + swiglu(x_TH, *shared), ids_TK, scores_TE


def test_deepseek_v4_routing_equals_formula():
    E, I, S = 16, 8, 12
    gen = torch.Generator().manual_seed(4)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    w = {"gate.weight": rand(E, H) * 0.3, "gate.bias": rand(E) * 0.3}
    for e in range(E):
        for proj, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            w[f"experts.{e}.{proj}.weight"] = rand(*shape)
    for proj, shape in (("w1", (S, H)), ("w3", (S, H)), ("w2", (H, S))):
        w[f"shared_experts.{proj}.weight"] = rand(*shape)
    spec = DraftMoeFFNSpec(
        router=RouterSpec(
            num_experts=E,
            top_k=4,
            scoring="sqrtsoftplus",
            renorm_eps=1e-20,
            routed_scaling_factor=1.5,
            bias="selection",
        ),
        intermediate_size=I,
        activation=ActivationSpec(limit=10.0),
        shared_intermediate_size=S,
    )
    moe = DraftMoE(spec, H, layer_id=0)
    load_ffn(moe, {f"layers.0.ffn.{k}": v for k, v in w.items()}, layer_id=0)
    for T in TOKENS:
        x_TH = rand(T, H)
        with torch.no_grad():
            y_TH = moe(x_TH)
            ids_TK, _ = moe.router(x_TH)
        ref_TH, ref_ids_TK, scores_TE = _deepseek_v4_reference(x_TH, w)
        assert torch.equal(ids_TK.sort(-1).values, ref_ids_TK.sort(-1).values)
        if T:
            assert _rel_err(y_TH, ref_TH) <= REL_TOL
    # The case is only meaningful if the bias changed some choices and the clamp was hit.
    unbiased = scores_TE.topk(4, dim=-1).indices.sort(-1).values
    assert not torch.equal(unbiased, ref_ids_TK.sort(-1).values)
    assert (x_TH @ w["experts.0.w1.weight"].T).abs().max() > 10.0
