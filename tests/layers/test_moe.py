"""DraftMoE composition: zero rows still enter dispatch/combine, EP shards sum to the replicated layer, build_ffn."""

from __future__ import annotations

import pytest
import torch

from epdraft.config.ffn import ActivationSpec, DraftDenseFFNSpec, DraftMoeFFNSpec, RouterSpec
from epdraft.config.hf import DraftMixFFNSpec
from epdraft.dispatch.base import ReplicatedDispatcher
from epdraft.dispatch.layout import MoeLayout
from epdraft.errors import ConfigError
from epdraft.layers import DraftMLP, DraftMoE, build_ffn
from tests.stubs import LocalIdsDispatcher, shard_layout

E, I, H, S = 8, 16, 32, 12
SPEC = DraftMoeFFNSpec(
    router=RouterSpec(num_experts=E, top_k=3, scoring="sigmoid", bias="selection", renorm_eps=1e-20),
    intermediate_size=I,
    activation=ActivationSpec(limit=5.0),
    shared_intermediate_size=S,
    shared_gate=True,
)


def _random_weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "gate.weight": torch.randn(E, H, generator=gen),
        "gate.bias": torch.randn(E, generator=gen) * 0.1,
        "experts.w1": torch.randn(E, I, H, generator=gen),
        "experts.w3": torch.randn(E, I, H, generator=gen),
        "experts.w2": torch.randn(E, H, I, generator=gen),
        "shared_expert.gate_proj.weight": torch.randn(S, H, generator=gen),
        "shared_expert.up_proj.weight": torch.randn(S, H, generator=gen),
        "shared_expert.down_proj.weight": torch.randn(H, S, generator=gen),
        "shared_expert_gate.weight": torch.randn(1, H, generator=gen),
    }


class RecordingDispatcher(ReplicatedDispatcher):
    """Replicated, but records every call so a test can see that zero-row ranks still enter them."""

    def __init__(self) -> None:
        super().__init__(MoeLayout.local(E, H, SPEC.top_k))
        self.calls: list[tuple[str, int]] = []

    def dispatch(self, x_TH, topk_ids_TK, topk_weights_TK, plan=None):
        self.calls.append(("dispatch", x_TH.shape[0]))
        return super().dispatch(x_TH, topk_ids_TK, topk_weights_TK, plan)

    def combine(self, expert_out_RH, handle):
        self.calls.append(("combine", expert_out_RH.shape[0]))
        return super().combine(expert_out_RH, handle)


def test_zero_rows_still_dispatch_and_combine():
    dispatcher = RecordingDispatcher()
    moe = DraftMoE(SPEC, H, layer_id=0, dispatcher=dispatcher)
    moe.load_weights(_random_weights(0))
    moe.check_loaded()
    y_TH = moe(torch.empty(0, H))
    assert y_TH.shape == (0, H)
    assert dispatcher.calls == [("dispatch", 0), ("combine", 0)]


def test_ep_shards_sum_to_replicated_layer():
    weights = _random_weights(1)
    full = DraftMoE(SPEC, H)
    full.load_weights(weights)
    x_TH = torch.randn(9, H, generator=torch.Generator().manual_seed(2))
    ep = 4
    with torch.no_grad():
        ref_TH = full(x_TH)
        shared_TH = full.shared(x_TH)
        total_TH = torch.zeros_like(ref_TH)
        for rank in range(ep):
            shard = DraftMoE(SPEC, H, dispatcher=LocalIdsDispatcher(shard_layout(SPEC, H, ep_rank=rank, ep_size=ep)))
            shard.load_weights(weights)
            shard.check_loaded()
            total_TH += shard(x_TH) - shared_TH  # each rank adds the (replicated) shared expert itself
    torch.testing.assert_close(total_TH + shared_TH, ref_TH, rtol=1e-5, atol=1e-5)


def test_build_ffn_dense_and_moe_keep_router_fp32():
    mix = DraftMixFFNSpec(family="test", hidden_size=H, layers=(DraftDenseFFNSpec(intermediate_size=I), SPEC))
    dense = build_ffn(mix, 0, H, dtype=torch.bfloat16, device="cpu")
    moe = build_ffn(mix, 1, H, dtype=torch.bfloat16, device="cpu")
    assert isinstance(dense, DraftMLP) and dense.gate_proj.weight.dtype == torch.bfloat16
    assert isinstance(moe, DraftMoE) and moe.experts.w13.dtype == torch.bfloat16
    assert moe.router.weight.dtype == torch.float32 and moe.router.bias.dtype == torch.float32
    moe.load_weights(_random_weights(3))
    y_TH = moe(torch.randn(4, H, dtype=torch.bfloat16))
    assert y_TH.dtype == torch.bfloat16 and y_TH.shape == (4, H)


def test_build_ffn_refuses_bad_layer_and_placement():
    mix = DraftMixFFNSpec(family="test", hidden_size=H, layers=(SPEC,))
    with pytest.raises(ConfigError, match="layer_id 1 out of range"):
        build_ffn(mix, 1, H, dtype=torch.float32, device="cpu")
    with pytest.raises(ConfigError, match="hidden_size 16"):
        build_ffn(mix, 0, 16, dtype=torch.float32, device="cpu")
    with pytest.raises(ConfigError, match="draft.moe_ep = 3"):
        build_ffn(mix, 0, H, dtype=torch.float32, device="cpu", dispatcher=LocalIdsDispatcher(shard_layout(SPEC, H, ep_size=3)))
    with pytest.raises(ConfigError, match="draft.moe_tp = 3"):
        build_ffn(mix, 0, H, dtype=torch.float32, device="cpu", dispatcher=LocalIdsDispatcher(shard_layout(SPEC, H, tp_size=3)))
