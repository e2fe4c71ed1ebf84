"""Hash-routed MoE layers (DeepSeek-V4): equal transformers' DeepseekV4SparseMoeBlock, refuse a bad
`tid2eid`, and under alltoall and gather on 2 CPU ranks (idle ranks included) equal the
single-process layer, each EP shard loading only its experts' rows."""

from __future__ import annotations

import random

import pytest
import torch

from epdraft.config.hf import DraftMixFFNSpec
from epdraft.dispatch import Dispatcher, MoeLayout, StepPlan, make_dispatcher
from epdraft.errors import ConfigError, LoadError
from epdraft.layers import DraftMoE, build_ffn
from epdraft.loading import load_ffn
from tests.harness import run_ranks

H, V, E, K, I = 32, 50, 8, 3, 16
TOKENS = (0, 1, 5, 67)


def hf_block(layer: int = 0, seed: int = 1):
    """transformers' DeepSeek-V4 MoE block (hash-routed for layer < 2) with random weights and table, and its config."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    config = DeepseekV4Config(hidden_size=H, vocab_size=V, n_routed_experts=E, num_experts_per_tok=K,
                              moe_intermediate_size=I, num_hidden_layers=4, num_hash_layers=2)
    config._experts_implementation = "eager"
    block = DeepseekV4SparseMoeBlock(config, layer).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in block.state_dict().items():
            if name == "gate.tid2eid":  # each token: K distinct experts
                t.copy_(torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(V)]))
            else:
                t.copy_(torch.randn(t.shape, generator=gen) * 0.4)
    return block, config.to_dict()


def draft_moe(config: dict, layer: int, dispatcher: Dispatcher | None = None) -> DraftMoE:
    spec = DraftMixFFNSpec.from_config(config)
    return build_ffn(spec, layer, H, dtype=torch.float32, device="cpu", dispatcher=dispatcher)


def test_hash_layer_equals_transformers_deepseek_v4_block():
    block, config = hf_block()
    moe = draft_moe(config, 0)
    assert moe.spec.router.hash_routed and moe.router.tid2eid.shape == (V, K)
    assert load_ffn(moe, block.state_dict(), layer_id=0) == set(block.state_dict())
    gen = torch.Generator().manual_seed(2)
    for T in TOKENS:
        x_TH, ids_T = torch.randn(T, H, generator=gen) * 2.0, torch.randint(0, V, (T,), generator=gen)
        with torch.no_grad():
            ref_TH = block(x_TH.unsqueeze(0), ids_T.unsqueeze(0))[0]
            _, hf_w_TK, hf_ids_TK = block.gate(x_TH.unsqueeze(0), ids_T.unsqueeze(0))
            ids_TK, w_TK = moe.router(x_TH, ids_T)
            y_TH = moe(x_TH, None, ids_T)
        assert torch.equal(ids_TK, hf_ids_TK) and torch.equal(ids_TK, block.gate.tid2eid[ids_T])
        if T:
            torch.testing.assert_close(w_TK, hf_w_TK.float(), rtol=1e-5, atol=1e-6)
            assert ((y_TH - ref_TH).norm() / ref_TH.norm()).item() <= 1e-5
    # The table, not the scores, picks the experts: a top-k router on the same weights disagrees.
    with torch.no_grad():
        topk = torch.nn.functional.softplus(x_TH @ moe.router.weight.T).sqrt().topk(K, dim=-1).indices
    assert not torch.equal(topk.sort(-1).values, ids_TK.sort(-1).values)


def test_hash_layer_needs_the_token_ids():
    _, config = hf_block()
    moe = draft_moe(config, 0)
    with pytest.raises(ConfigError, match=r"hash-routed router: needs input_ids_T \[4\], got None"):
        moe(torch.zeros(4, H))
    with pytest.raises(ConfigError, match=r"needs input_ids_T \[4\], got \[3\]"):
        moe(torch.zeros(4, H), None, torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("table, needle", [
    (torch.full((V, K), E), r"gate\.tid2eid: expert ids must lie in \[0, 8\), found \[8, 8\]"),
    (torch.full((V, K), -1), r"gate\.tid2eid: expert ids must lie in \[0, 8\), found \[-1, -1\]"),
    (torch.zeros(V, K + 1, dtype=torch.long), r"gate\.tid2eid: expected shape \[50, 3\], found \[50, 4\]"),
    (torch.zeros(V - 1, K, dtype=torch.long), r"gate\.tid2eid: expected shape \[50, 3\], found \[49, 3\]"),
    (torch.zeros(V, K), r"gate\.tid2eid: expected integer expert ids, found dtype torch\.float32"),
])
def test_bad_token_tables_are_refused(table, needle):
    block, config = hf_block()
    state = dict(block.state_dict()) | {"gate.tid2eid": table}
    with pytest.raises(LoadError, match=needle):
        load_ffn(draft_moe(config, 0), state, layer_id=0)


def test_missing_token_table_is_named():
    block, config = hf_block()
    state = {k: v for k, v in block.state_dict().items() if k != "gate.tid2eid"}
    with pytest.raises(LoadError, match=r"layers\.0\.mlp\.gate\.tid2eid"):
        load_ffn(draft_moe(config, 0), state, layer_id=0)
    # A top-k layer has no place for a table: refused, not dropped.
    with pytest.raises(LoadError, match="gate.tid2eid"):
        load_ffn(draft_moe(config, 2), {f"layers.2.mlp.{k}": v for k, v in block.state_dict().items()}, layer_id=2)


def _rank_case(rank: int, world: int, layout: str, padding: str, steps: int) -> dict:
    """One layout on `world` ranks: this rank's EP shard, loaded from the whole export, against the
    single-process layer on the same rows and token ids, for steps of random counts (zeros included)."""
    import torch.distributed as dist

    block, config = hf_block()
    state = {f"model.layers.0.mlp.{k}": v for k, v in block.state_dict().items()}
    full = draft_moe(config, 0)
    load_ffn(full, state, layer_id=0)
    moe_layout = MoeLayout(layout=layout, dp_padding=padding, ep_rank=rank, ep_size=world,
                           num_experts=E, hidden_size=H, top_k=K)
    dispatcher = make_dispatcher(moe_layout, dist.group.WORLD)
    moe = draft_moe(config, 0, dispatcher)
    load_ffn(moe, state, layer_id=0)
    e = E // world
    # Only this rank's experts' rows of every expert tensor; the router and its table are whole.
    gate_up = block.experts.gate_up_proj.detach()
    shard_ok = (moe.experts.w13.shape[0] == e and torch.equal(moe.experts.w13, gate_up[rank * e:(rank + 1) * e])
                and torch.equal(moe.experts.w2, block.experts.down_proj.detach()[rank * e:(rank + 1) * e])
                and torch.equal(moe.router.tid2eid, block.gate.tid2eid))
    rng, worst, compared, idle = random.Random(7), 0.0, 0, 0
    for step in range(steps):
        # Same seeded draws on every rank stand in for the step's sync; every third step one rank idles.
        counts = [rng.choice([0, 1, 3, 7]) for _ in range(world)]
        if step % 3 == 0:
            counts[step % world] = 0
        plan = StepPlan(step=step, ranks=tuple(range(world)), counts=tuple(counts))
        if plan.skip:
            continue
        gen = torch.Generator().manual_seed(1000 * step + rank)
        n = plan.counts[rank]
        x, ids = torch.randn(n, H, generator=gen), torch.randint(0, V, (n,), generator=gen)
        with torch.no_grad():
            y, ref = moe(x, plan, ids), full(x, None, ids)
        if n == 0:
            idle += 1
            continue
        worst = max(worst, ((y - ref).abs().max() / ref.abs().max()).item())
        compared += 1
    dispatcher.close()
    return {"shard_ok": shard_ok, "worst": worst, "compared": compared, "idle": idle}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout, padding", [("alltoall", "max_len"), ("gather", "max_len"), ("gather", "sum_len")])
def test_hash_layer_under_ep_layouts_equals_single_process(layout, padding):
    reports = run_ranks(2, _rank_case, layout, padding, 24, timeout_s=110)
    for rank, r in enumerate(reports):
        assert r["shard_ok"], (rank, r)
        assert r["compared"] > 0 and r["idle"] > 0, (rank, r)
        assert r["worst"] <= 1e-5, (rank, r)
