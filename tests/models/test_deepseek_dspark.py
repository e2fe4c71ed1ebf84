"""DeepseekDSparkDraft (issue 31): the pooled step over K=V rings equals an uncached step over each
request's whole context with the window applied; pool bytes do not grow with max_context; the export
names round-trip; N = 0 still runs every FFN."""

import pytest
import torch
from torch import nn

from epdraft.loading import DictSource
from epdraft.models.checkpoint import load_draft_weights
from epdraft.models.deepseek_attention import context_window, fp8_ue8m0_roundtrip
from epdraft.models.deepseek_dspark import DeepseekDSparkDraft
from epdraft.models.deepseek_names import to_export_state_dict
from epdraft.models.protocol import DRAFT_FAMILIES
from epdraft.models.spec import DraftModelSpec
from tests.models.helpers import randomize

H, V, WINDOW = 32, 50, 8


def tiny_config(*, kv_fake_quant: bool = True, window: int = WINDOW, variant: str = "v4") -> dict:
    config = {
        "architectures": ["DSparkV4DraftModel"], "model_type": "deepseek_v4_dspark_draft", "block_size": 5,
        "dflash_config": {"confidence_head_with_markov": True, "enable_confidence_head": True,
                          "kv_fake_quant": kv_fake_quant, "markov_head_type": "vanilla", "markov_rank": 8,
                          "mask_token_id": V - 1, "projector_type": "dspark_v4", "target_layer_ids": [0, 1]},
        "hidden_size": H, "vocab_size": V, "num_hidden_layers": 2, "rms_norm_eps": 1e-6,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "qk_rope_head_dim": 4,
        "q_lora_rank": 8, "o_lora_rank": 8, "o_groups": 2, "sliding_window": window, "rope_theta": 10000.0,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4,
        "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    }  # fmt: skip
    if variant == "v41":  # SpecForge's converted V4.1 config
        config["dflash_config"].update(attention_mode="deepseek_v41", context_window=config.pop("sliding_window"))
    return config


class Heads:
    def __init__(self, seed: int = 1):
        gen = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(V, H, generator=gen)
        self.head = torch.randn(V, H, generator=gen) * 2

    def embed(self, ids):
        return self.emb[ids]

    def lm_head(self, hidden):
        return hidden.float() @ self.head.T


def make_draft(**kw) -> DeepseekDSparkDraft:
    torch.manual_seed(0)
    draft = DRAFT_FAMILIES["dspark_v4"](DraftModelSpec.from_config(tiny_config(**kw)), dtype=torch.float32,
                                        device="cpu", dispatcher=None, kernels=None)  # fmt: skip
    randomize(draft, seed=3, scale=0.3)
    return draft.eval()


@torch.no_grad()
def uncached_reference(draft, features, anchors_N, heads):
    """Each request's whole context projected at once, its last `window` rows gathered (context_window)."""
    lengths_N = torch.tensor([f.shape[0] for f in features])
    L = int(lengths_N.max())
    padded = torch.zeros(len(features), L, features[0].shape[1])
    for n, f in enumerate(features):
        padded[n, : f.shape[0]] = f
    main_NLH = draft.fuse_features(padded)
    positions_NL = torch.arange(L).expand(len(features), L)
    windows = [context_window(layer.attn.context_kv(main_NLH, positions_NL), lengths_N, draft.window)
               for layer in draft.layers]  # fmt: skip
    prenorm, _ = draft.block_hidden(anchors_N, lengths_N, windows, heads, None)
    return prenorm, draft.read_out(draft.draft_rows(prenorm), anchors_N, heads)


def assert_loads_back(draft, export: dict, other) -> None:
    """`export` loaded into `other` (zeroed first) gives back `draft`'s every tensor."""
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    load_draft_weights(other, DictSource(export))
    for (name, a), b in zip(draft.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("variant", ["v4", "v41"])
@pytest.mark.parametrize("kv_fake_quant", [False, True])
def test_pooled_step_equals_uncached_window(kv_fake_quant, variant):
    draft, heads = make_draft(kv_fake_quant=kv_fake_quant, variant=variant), Heads()
    gen = torch.Generator().manual_seed(5)
    lengths, chunks = [3, 11, 20, 8], [[3], [4, 7], [1, 12, 7], [8]]  # rings partly filled, wrapped, exact
    features = [torch.randn(n, 2 * H, generator=gen) for n in lengths]
    pool = draft.new_pool(max_requests=6, max_context=64)
    for rid in range(len(lengths)):
        pool.admit(rid)
    for rid, parts in enumerate(chunks):
        start = 0
        for n in parts:
            draft.extend(pool, [rid], [features[rid][start : start + n]])
            start += n
    slots_N = torch.tensor([pool.slot(r) for r in range(len(lengths))])
    anchors_N = torch.tensor([5, 7, 11, 13])
    step = draft.step(pool, slots_N, anchors_N, heads, None)
    windows = [pool.window_of(i, slots_N) for i in range(len(draft.layers))]
    prenorm, finite = draft.block_hidden(anchors_N, pool.lengths[slots_N].long(), windows, heads, None)
    ref_prenorm, (ref_drafts, ref_conf, _) = uncached_reference(draft, features, anchors_N, heads)
    # The ring's row order is not the reference's, so the softmax sums differ by fp32 ulps of the
    # largest rows (V4.1's unweighted readout keeps rows ~40 wide): absolute tolerance scales with them.
    atol = 1e-6 * float(ref_prenorm.abs().max())
    torch.testing.assert_close(prenorm, ref_prenorm, atol=atol, rtol=1e-5)
    assert torch.equal(step.drafts_NK, ref_drafts) and step.drafts_NK.shape == (4, 4)
    torch.testing.assert_close(step.confidence_NK, ref_conf, atol=1e-5, rtol=1e-5)
    assert bool(step.finite_L.all()) and bool(finite.all())


def test_window_hides_older_context():
    """A context row older than the window does not change the step (block-anchored window)."""
    draft, heads = make_draft(), Heads()
    gen = torch.Generator().manual_seed(2)
    f = torch.randn(12, 2 * H, generator=gen)
    g = f.clone()
    g[:12 - WINDOW] += 5.0
    a, _ = uncached_reference(draft, [f], torch.tensor([3]), heads)
    b, _ = uncached_reference(draft, [g], torch.tensor([3]), heads)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    g[12 - WINDOW] += 5.0
    c, _ = uncached_reference(draft, [g], torch.tensor([3]), heads)
    assert not torch.allclose(a, c)


def test_pool_bytes_independent_of_max_context():
    draft = make_draft()
    small = draft.new_pool(max_requests=4, max_context=16)
    large = draft.new_pool(max_requests=4, max_context=100_000)
    assert small.num_bytes == large.num_bytes == 2 * 5 * WINDOW * 16 * 4  # layers * slots * W * D * fp32


def test_idle_step_runs_every_ffn():
    draft, heads = make_draft(), Heads()
    pool = draft.new_pool(max_requests=2, max_context=16)
    calls = []
    for layer in draft.layers:
        layer.mlp.register_forward_hook(lambda m, i, o: calls.append(tuple(o.shape)))
    step = draft.step(pool, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), heads, None)
    assert calls == [(0, H), (0, H)] and step.drafts_NK.shape == (0, 4)


def test_export_names_round_trip():
    draft = make_draft()
    export = to_export_state_dict(draft, 2)
    assert "mtp.0.main_proj.weight" in export and "mtp.1.hc_head_fn" in export
    assert "mtp.0.attn.wq_a.weight" in export and "mtp.1.ffn.experts.3.w2.weight" in export
    assert "mtp.0.ffn.gate.bias" in export and "mtp.0.ffn.shared_experts.w1.weight" in export
    assert "mtp.0.hc_attn_fn" in export and "confidence_head.proj.weight" in export
    assert_loads_back(draft, export, make_draft())


def test_fp8_roundtrip_matches_power_of_two_scales():
    x = torch.tensor([[0.3, -1.7, 448.0 * 4, 0.0]])
    y = fp8_ue8m0_roundtrip(x)
    assert y[0, 2] == 448.0 * 4 and y[0, 3] == 0 and abs(float(y[0, 1]) + 1.7) < 0.1


def test_loader_is_strict_and_takes_official_head_names(tmp_path):
    import json

    from safetensors.torch import save_file

    from epdraft.errors import LoadError
    from epdraft.models import load_draft

    draft = make_draft()
    export = to_export_state_dict(draft, 2)
    export["mtp.1.markov_head.markov_w1.weight"] = export.pop("markov_head.markov_w1.weight")  # official naming
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    save_file(export, str(tmp_path / "model.safetensors"))
    loaded = load_draft(tmp_path)
    assert torch.equal(loaded.markov_head.markov_w1.weight, draft.markov_head.markov_w1.weight)
    del export["mtp.0.hc_attn_fn"], export["mtp.1.ffn.gate.bias"]
    save_file(export, str(tmp_path / "model.safetensors"))
    with pytest.raises(LoadError, match=r"layers\.0\.attn_hc\.fn.*layers\.1\.mlp\.gate\.bias"):
        load_draft(tmp_path)


def test_v41_builds_the_v41_pieces_and_round_trips(tmp_path, caplog):
    """V4.1: no per-head q norm, single-pass mHC on every sublayer, no hc_head; the export has no
    hc_head_* and loads back; an export that carries them is reported as unused."""
    import json

    from safetensors.torch import save_file

    from epdraft.models import load_draft

    draft = make_draft(variant="v41")
    assert draft.hc_head is None and not any(n.startswith("hc_head.") for n, _ in draft.named_parameters())
    assert all(not layer.attn.q_norm and layer.attn_hc.single_pass and layer.ffn_hc.single_pass
               for layer in draft.layers)  # fmt: skip
    export = to_export_state_dict(draft, 2)
    assert not any("hc_head" in n for n in export) and "mtp.1.hc_ffn_fn" in export
    assert_loads_back(draft, export, make_draft(variant="v41"))
    export["mtp.1.hc_head_fn"] = torch.zeros(4, 4 * H)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(variant="v41")))
    save_file(export, str(tmp_path / "model.safetensors"))
    load_draft(tmp_path)
    assert "not used by the draft: hc_head.fn" in caplog.text


def test_v41_differs_from_v4_on_the_same_weights():
    """The variant switch reaches the step: the same shared weights give other hidden rows."""
    v4, v41, heads = make_draft(), make_draft(variant="v41"), Heads()
    v41.load_state_dict({k: v for k, v in v4.state_dict().items() if not k.startswith("hc_head.")})
    features, anchors = [torch.randn(6, 2 * H, generator=torch.Generator().manual_seed(8))], torch.tensor([4])
    a, _ = uncached_reference(v4, features, anchors, heads)
    b, _ = uncached_reference(v41, features, anchors, heads)
    assert torch.isfinite(b).all() and not torch.allclose(a, b)
