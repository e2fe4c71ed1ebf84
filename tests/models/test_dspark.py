"""DSparkDraft: every Markov head and both readouts against the published formulas, the confidence
head with and without Markov input, the bundled-target keys, loading and refusals."""

import math

import pytest
import torch

from epdraft.errors import ConfigError, LoadError
from epdraft.models import DraftModelSpec, DSparkDraft, load_draft, speculative_generate
from epdraft.models.dspark import gated_latent, rnn_step
from epdraft.models.reference import extend_caches, new_cache, reference_hidden, reference_step
from tests.models.helpers import H, VOCAB, draft_config, hf_greedy, randomize, tiny_target, write_export
from tests.models.test_dflash import Heads

HEADS = ("vanilla", "gated", "rnn")
R = 6  # markov_rank of draft_config


def make_dspark(seed=0, *, markov="vanilla", block_size=5, **kw) -> DSparkDraft:
    draft = DSparkDraft(DraftModelSpec.from_config(draft_config(dspark=True, block_size=block_size, markov=markov, **kw)))
    randomize(draft, seed, scale=0.5)
    return draft.eval()


def contexts(lens=(4, 7), seed=2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 2 * H, generator=gen) for n in lens]


def caches_of(draft, lens=(4, 7), seed=2):
    caches = []
    for features in contexts(lens, seed):
        c = new_cache(draft)
        extend_caches(draft, [c], [features])
        caches.append(c)
    return caches


def pooled_step(draft, anchors, heads, lens=(4, 7), seed=2):
    """`draft.step` for requests holding `caches_of`'s contexts in a KV pool."""
    pool = draft.new_pool(max_requests=max(1, len(lens)), max_context=32)
    for rid in range(len(lens)):
        pool.admit(rid)
    draft.extend(pool, list(range(len(lens))), contexts(lens, seed))
    slots = torch.tensor([pool.slot(r) for r in range(len(lens))], dtype=torch.long)
    return draft.step(pool, slots, anchors, heads, None)


def reference_decode(draft, base_kV, hidden_kH, anchor: int) -> tuple[list[int], list[torch.Tensor]]:
    """One request, straight from SpecForge's dspark_heads formulas: the drafts and each step's logits."""
    m = draft.markov_head
    W1, W2 = m.markov_w1.weight.detach().double(), m.markov_w2.weight.detach().double()
    state = torch.zeros(R, dtype=torch.float64)
    prev, drafts, logits = anchor, [], []
    for k in range(base_kV.shape[0]):
        e, h = W1[prev], hidden_kH[k].double()
        if m.kind == "vanilla":
            latent = e
        elif m.kind == "gated":
            Wg, bg = m.gate_proj.weight.detach().double(), m.gate_proj.bias.detach().double()
            z = torch.cat([h, e])  # hidden first, then the previous token's embedding
            latent = torch.tensor([1 / (1 + math.exp(-float(Wg[i] @ z + bg[i]))) for i in range(R)]) * e
        else:
            Wj, bj = m.joint_proj.weight.detach().double(), m.joint_proj.bias.detach().double()
            a = Wj @ torch.cat([state, e, h]) + bj
            g = 1 / (1 + torch.exp(-a[:R]))
            state = g * state + (1 - g) * torch.tanh(a[R:2 * R])
            latent = torch.tanh(a[2 * R:])
        step = base_kV[k].double() + W2 @ latent
        logits.append(step)
        prev = int(step.argmax())
        drafts.append(prev)
    return drafts, logits


@pytest.mark.parametrize("mask_filling", [True, False])
@pytest.mark.parametrize("markov", HEADS)
def test_markov_readout_matches_formula(markov, mask_filling):
    """prev_0 = anchor; logits_k = lm_head(h_k) + W2 latent(prev_k, h_k); prev_{k+1} = argmax, per request.

    Mask-filling: h_k = block row k + 1, B-1 drafts; autoregressive: h_k = block row k, B drafts.
    """
    draft, heads = make_dspark(1, markov=markov, mask_filling=mask_filling), Heads()
    caches, anchors = caches_of(draft), torch.tensor([7, 33])
    drafts = reference_step(draft, caches, anchors, heads).drafts_NK
    B = draft.block_size
    assert drafts.shape == (2, B - 1 if mask_filling else B) == (2, draft.num_drafts)
    with torch.no_grad():
        hidden = reference_hidden(draft, caches, anchors, heads)[0]
    rows = hidden[:, 1:] if mask_filling else hidden
    base = heads.lm_head(rows)
    for i in range(2):
        want, _ = reference_decode(draft, base[i], rows[i], int(anchors[i]))
        assert drafts[i].tolist() == want
    # The Markov term changes the drafts here: the plain DFlash readout would differ.
    assert not torch.equal(drafts, base.argmax(-1))


@pytest.mark.parametrize("markov", ["gated", "rnn"])
def test_markov_step_math_matches_reference_fp32(markov):
    """The latent of one step [N, r] at 1e-5 against the double-precision reference, odd N."""
    draft = make_dspark(4, markov=markov)
    gen = torch.Generator().manual_seed(9)
    N = 5
    prev, h = torch.randint(0, VOCAB, (N,), generator=gen), torch.randn(N, H, generator=gen)
    m = draft.markov_head
    e = m.markov_w1(prev).detach()
    if markov == "gated":
        got = gated_latent(e, h, m.gate_proj.weight.detach(), m.gate_proj.bias.detach())
        want = torch.sigmoid(torch.cat([h, e], -1).double() @ m.gate_proj.weight.double().T + m.gate_proj.bias.double()) * e.double()
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-6)
        return
    s0 = torch.randn(N, R, generator=gen)
    s1, latent = rnn_step(s0, e, h, m.joint_proj.weight.detach(), m.joint_proj.bias.detach())
    a = torch.cat([s0, e, h], -1).double() @ m.joint_proj.weight.double().T + m.joint_proj.bias.double()
    g = torch.sigmoid(a[:, :R])
    torch.testing.assert_close(s1.double(), (g * s0.double() + (1 - g) * torch.tanh(a[:, R:2 * R])).detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(latent.double(), torch.tanh(a[:, 2 * R:]).detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mask_filling", [True, False])
@pytest.mark.parametrize("with_markov", [True, False])
def test_confidence_head_scores_each_draft(with_markov, mask_filling):
    """confidence_k = sigmoid(w . [h_k (, W1[prev_k])] + b): h_k the row that drafted token k, prev_k the token before it."""
    draft = make_dspark(3, markov="rnn", confidence_with_markov=with_markov, mask_filling=mask_filling)
    heads, caches, anchors = Heads(), caches_of(draft, (3, 6)), torch.tensor([2, 41])
    reference = reference_step(draft, caches, anchors, heads)
    drafts, conf = reference.drafts_NK, reference.confidence_NK
    step = pooled_step(draft, anchors, heads, (3, 6))  # the runtime's step carries the same scores
    assert torch.equal(step.drafts_NK, drafts) and torch.allclose(step.confidence_NK, conf, rtol=0, atol=1e-6)
    with torch.no_grad():
        hidden = reference_hidden(draft, caches, anchors, heads)[0]
    rows = hidden[:, 1:] if mask_filling else hidden
    w, b = draft.confidence_head.proj.weight.detach().double()[0], float(draft.confidence_head.proj.bias.detach())
    assert w.shape == (H + R if with_markov else H,)
    W1 = draft.markov_head.markov_w1.weight.detach().double()
    for i in range(2):
        prev = [int(anchors[i])] + drafts[i, :-1].tolist()
        for k in range(draft.num_drafts):
            x = rows[i, k].double() if not with_markov else torch.cat([rows[i, k].double(), W1[prev[k]]])
            assert abs(float(conf[i, k]) - 1 / (1 + math.exp(-(float(w @ x) + b)))) < 1e-5


def test_zero_row_dspark_propose():
    for mask_filling in (True, False):
        draft = make_dspark(markov="gated", mask_filling=mask_filling)
        step = pooled_step(draft, torch.zeros(0, dtype=torch.long), Heads(), lens=())
        assert step.drafts_NK.shape == step.confidence_NK.shape == (0, draft.num_drafts)
        reference = reference_step(draft, [], torch.zeros(0, dtype=torch.long), Heads())
        assert reference.drafts_NK.shape == reference.confidence_NK.shape == (0, draft.num_drafts)


@pytest.mark.parametrize("markov", HEADS)
def test_export_roundtrip_and_confidence_load(tmp_path, markov):
    cfg, draft = draft_config(dspark=True, block_size=5, markov=markov), make_dspark(3, markov=markov)
    loaded = load_draft(write_export(draft, cfg, tmp_path / "dspark"))
    assert isinstance(loaded, DSparkDraft) and loaded.markov_head.kind == markov
    for (n, p), (n2, p2) in zip(draft.named_parameters(), loaded.named_parameters()):
        assert n == n2 and torch.equal(p, p2)
    partial = write_export(draft, cfg, tmp_path / "no-conf", drop=("confidence_head.proj.weight",))
    with pytest.raises(LoadError, match=r"confidence_head\.proj\.weight"):
        load_draft(partial)


@pytest.mark.parametrize("name, shape", [
    ("markov_head.gate_proj.weight", (R, H)),             # [r, H + r] expected
    ("markov_head.gate_proj.bias", (R + 1,)),
])
def test_wrong_shape_gated_tensors_are_refused(tmp_path, name, shape):
    cfg, draft = draft_config(dspark=True, markov="gated"), make_dspark(markov="gated", block_size=4)
    path = write_export(draft, cfg, tmp_path / "bad", drop=(name,), extra={name: torch.zeros(shape)})
    with pytest.raises(LoadError, match=rf"{name}: expected shape"):
        load_draft(path)


def test_wrong_shape_or_missing_rnn_tensors_are_refused(tmp_path):
    cfg, draft = draft_config(dspark=True, markov="rnn"), make_dspark(markov="rnn", block_size=4)
    bad = write_export(draft, cfg, tmp_path / "bad", drop=("markov_head.joint_proj.weight",),
                       extra={"markov_head.joint_proj.weight": torch.zeros(3 * R, R + H)})
    with pytest.raises(LoadError, match=rf"markov_head\.joint_proj\.weight: expected shape \[{3 * R}, {2 * R + H}\]"):
        load_draft(bad)
    missing = write_export(draft, cfg, tmp_path / "missing", drop=("markov_head.joint_proj.bias",))
    with pytest.raises(LoadError, match=r"markov_head\.joint_proj\.bias"):
        load_draft(missing)
    # A vanilla config has no place for the rnn head's tensors: refused (SGLang too), never dropped.
    with pytest.raises(LoadError, match=r"markov_head\.joint_proj\.bias, markov_head\.joint_proj\.weight.*markov_head_type"):
        load_draft(write_export(draft, draft_config(dspark=True), tmp_path / "as-vanilla"))


def test_unknown_markov_head_and_bad_rank_are_refused():
    cfg = draft_config(dspark=True)
    cfg["dflash_config"]["markov_head_type"] = "lstm"
    with pytest.raises(ConfigError, match=r"markov_head_type = 'lstm': expected one of \['vanilla', 'gated', 'rnn'\]"):
        DraftModelSpec.from_config(cfg)
    cfg["dflash_config"] |= {"markov_head_type": "vanilla", "markov_rank": 0}
    with pytest.raises(ConfigError, match="markov_rank = 0"):
        DraftModelSpec.from_config(cfg)
    cfg = draft_config(dspark=True, mask_filling=True)
    cfg["dflash_config"]["mask_filling"] = "yes"
    with pytest.raises(ConfigError, match="mask_filling = 'yes'"):
        DraftModelSpec.from_config(cfg)


def bundled(cfg: dict, *, table: bool) -> dict:
    """The same draft as a target checkpoint bundling its DSpark head: `dspark_*` keys or a `dspark_config` table."""
    dfl = cfg.pop("dflash_config")
    cfg["architectures"] = ["DeepseekV4ForCausalLM"]
    if table:
        cfg["dspark_config"] = {"block_size": cfg.pop("block_size"), "markov_rank": dfl["markov_rank"],
                                "markov_head_type": dfl["markov_head_type"], "mask_token_id": dfl["mask_token_id"],
                                "target_layer_ids": dfl["target_layer_ids"]}
    else:
        cfg |= {"dspark_block_size": cfg.pop("block_size"), "dspark_markov_rank": dfl["markov_rank"],
                "dspark_markov_head_type": dfl["markov_head_type"], "dspark_noise_token_id": dfl["mask_token_id"],
                "dspark_target_layer_ids": dfl["target_layer_ids"]}
    cfg |= {k: dfl[k] for k in ("enable_confidence_head", "confidence_head_with_markov")}
    return cfg


@pytest.mark.parametrize("table", [False, True])
def test_bundled_target_keys_give_the_same_spec(table):
    cfg = draft_config(dspark=True, block_size=6, markov="gated", layer_ids=(1, 2))
    spec = DraftModelSpec.from_config(cfg)
    assert DraftModelSpec.from_config(bundled(cfg, table=table)) == spec
    assert (spec.kind, spec.block_size, spec.markov_head_type, spec.target_layer_ids) == ("dspark", 6, "gated", (1, 2))


def test_bundled_keys_that_contradict_are_refused():
    cfg = bundled(draft_config(dspark=True, block_size=6), table=False) | {"block_size": 7}
    with pytest.raises(ConfigError, match="dspark_block_size = 6 contradicts block_size = 7"):
        DraftModelSpec.from_config(cfg)


@pytest.mark.parametrize("markov, mask_filling", [("gated", True), ("rnn", False), ("vanilla", False)])
def test_speculative_generate_is_lossless(markov, mask_filling):
    target = tiny_target(2)
    draft = make_dspark(6, markov=markov, mask_filling=mask_filling, moe=True)
    prompt, n = [3, 9, 27, 1, 40, 12, 5], 19
    out = speculative_generate(target, draft, prompt, n)
    want = hf_greedy(target, prompt, n)
    assert out.tokens == want
    assert all(0 <= a <= draft.num_drafts for a in out.accept_lens)
