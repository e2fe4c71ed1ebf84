"""DFlashDraft: attention against a naive reference, cached == uncached, 0-row propose, export loading."""

import math

import pytest
import torch

from epdraft.errors import ConfigError, LoadError, NonFiniteError
from epdraft.models import DFlashDraft, DraftModelSpec, check_against_target, load_draft, speculative_generate
from epdraft.models.attention import DFlashAttention
from epdraft.models.reference import extend_caches, new_cache, reference_hidden, reference_step
from tests.models.helpers import H, VOCAB, draft_config, hf_greedy, randomize, tiny_target, write_export

pytest.importorskip("transformers")


def naive_attention(attn: DFlashAttention, x_QH, pos_Q, ctx_LH, ctx_pos_L, allowed_QS=None):
    """Per-head loops straight from the DFlash formulas: rmsnorm, rotary pairs (i, i + D/2), softmax
    over the keys `allowed_QS` [Q, L + Q] permits (all of them when None)."""
    D, nh, g = attn.head_dim, attn.num_heads, attn.num_kv_heads

    def rms(v, w):
        return w * v / torch.sqrt(v.pow(2).mean() + attn.q_norm.eps)

    def rot(v, p):
        out = v.clone()
        for i in range(D // 2):
            a = p * attn.rope_theta ** (-2 * i / D)
            out[i] = v[i] * math.cos(a) - v[i + D // 2] * math.sin(a)
            out[i + D // 2] = v[i + D // 2] * math.cos(a) + v[i] * math.sin(a)
        return out

    keys_src = torch.cat([ctx_LH, x_QH])
    key_pos = torch.cat([ctx_pos_L, pos_Q]).tolist()
    out = torch.zeros(x_QH.shape[0], nh * D)
    for h in range(nh):
        kv = h // (nh // g)
        Wq = attn.q_proj.weight[h * D:(h + 1) * D]
        Wk, Wv = attn.k_proj.weight[kv * D:(kv + 1) * D], attn.v_proj.weight[kv * D:(kv + 1) * D]
        ks = [rot(rms(Wk @ s, attn.k_norm.weight), p) for s, p in zip(keys_src, key_pos)]
        vs = [Wv @ s for s in keys_src]
        for q in range(x_QH.shape[0]):
            qv = rot(rms(Wq @ x_QH[q], attn.q_norm.weight), int(pos_Q[q]))
            keep = [s for s in range(len(ks)) if allowed_QS is None or bool(allowed_QS[q, s])]
            w = torch.softmax(torch.stack([qv @ ks[s] for s in keep]) / math.sqrt(D), dim=0)
            out[q, h * D:(h + 1) * D] = sum(wi * vs[s] for wi, s in zip(w, keep))
    return out @ attn.o_proj.weight.T


def test_attention_matches_naive_reference():
    attn = DFlashAttention(H, 4, 2, 8, rms_norm_eps=1e-6, rope_theta=10000.0)
    randomize(attn, seed=1)
    gen = torch.Generator().manual_seed(2)
    ctx, x = torch.randn(5, H, generator=gen), torch.randn(4, H, generator=gen)
    ctx_pos, pos = torch.arange(5), torch.arange(5, 9)
    k, v = attn.context_kv(ctx.unsqueeze(0), ctx_pos.unsqueeze(0))
    got = attn(x.unsqueeze(0), pos.unsqueeze(0), k, v)[0]
    with torch.no_grad():
        want = naive_attention(attn, x, pos, ctx, ctx_pos)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def make_draft(seed=0, **kw) -> DFlashDraft:
    draft = DFlashDraft(DraftModelSpec.from_config(draft_config(**kw)))
    randomize(draft, seed)
    return draft.eval()


class Heads:
    """Stand-in target embedding / lm_head."""

    def __init__(self):
        gen = torch.Generator().manual_seed(5)
        self.E, self.W = torch.randn(VOCAB, H, generator=gen), torch.randn(VOCAB, H, generator=gen)

    def embed(self, ids):
        return self.E[ids]

    def lm_head(self, h):
        return h @ self.W.T


@pytest.mark.parametrize("moe", [True, False])
def test_cached_batched_propose_equals_uncached_forward(moe):
    draft, heads, B = make_draft(moe=moe), Heads(), 4
    gen = torch.Generator().manual_seed(3)
    feats = [torch.randn(n, 2 * H, generator=gen) for n in (7, 3, 5)]
    anchors = torch.tensor([4, 11, 30])
    caches = []
    for f in feats:  # context arrives in two pieces (prefill, then one verify's committed rows)
        c = new_cache(draft)
        extend_caches(draft, [c], [f[:2]])
        extend_caches(draft, [c], [f[2:]])
        caches.append(c)
    got = reference_hidden(draft, caches, anchors, heads)[0]
    for i, f in enumerate(feats):
        ids = torch.tensor([int(anchors[i])] + [draft.spec.mask_token_id] * (B - 1))
        L = f.shape[0]
        with torch.no_grad():
            want = draft(heads.embed(ids).unsqueeze(0), torch.arange(L, L + B).unsqueeze(0),
                         draft.fuse_features(f).unsqueeze(0), torch.arange(L).unsqueeze(0))
        torch.testing.assert_close(got[i], want[0], rtol=1e-4, atol=1e-5)
    drafts = reference_step(draft, caches, anchors, heads).drafts_NK
    assert drafts.shape == (3, B - 1) and drafts.dtype == torch.long
    torch.testing.assert_close(drafts, heads.lm_head(got[:, 1:]).argmax(-1))


def test_zero_row_propose_runs_every_ffn_once():
    draft, calls = make_draft(), []
    for layer in draft.layers:
        layer.mlp.register_forward_hook(lambda m, args, out: calls.append((tuple(args[0].shape), tuple(out.shape))))
    drafts = reference_step(draft, [], torch.zeros(0, dtype=torch.long), Heads()).drafts_NK
    assert drafts.shape == (0, 3)
    assert calls == [((0, H), (0, H))] * 2


@pytest.mark.parametrize("moe", [True, False])
def test_propose_names_the_first_layer_whose_hidden_states_go_non_finite(moe):
    draft, heads = make_draft(moe=moe), Heads()
    cache = new_cache(draft)
    extend_caches(draft, [cache], [torch.randn(5, 2 * H, generator=torch.Generator().manual_seed(1))])
    anchors = torch.tensor([4])
    assert reference_step(draft, [cache], anchors, heads).drafts_NK.shape == (1, 3)  # finite weights: no error
    with torch.no_grad():
        draft.layers[1].post_attention_layernorm.weight.fill_(float("inf"))  # layer 0 stays finite
    with pytest.raises(NonFiniteError, match=r"draft layer 1's hidden states went NaN or inf"):
        reference_step(draft, [cache], anchors, heads).drafts_NK


def test_load_specforge_export_roundtrip(tmp_path):
    cfg, draft = draft_config(), make_draft(seed=4)
    target_only = {"embed_tokens.weight": torch.zeros(VOCAB, H), "model.lm_head.weight": torch.zeros(VOCAB, H)}
    path = write_export(draft, cfg, tmp_path / "export", prefix="model.", extra=target_only)
    loaded = load_draft(path)
    for (n, p), (n2, p2) in zip(draft.named_parameters(), loaded.named_parameters()):
        assert n == n2
        torch.testing.assert_close(p, p2, rtol=0, atol=0)
    names = set(__import__("safetensors").safe_open(str(path / "model.safetensors"), "pt").keys())
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names
    assert "model.layers.0.mlp.shared_expert_gate.weight" in names


def test_partial_export_is_refused_naming_tensors(tmp_path):
    cfg, draft = draft_config(), make_draft()
    path = write_export(draft, cfg, tmp_path / "partial", drop=("fc.weight", "layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(LoadError, match=r"partial export, 2 missing: fc\.weight; .*layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        load_draft(path)


def test_spec_errors_name_the_key():
    cfg = draft_config()
    del cfg["dflash_config"]["mask_token_id"]
    with pytest.raises(ConfigError, match="config.json: missing key 'mask_token_id'"):
        DraftModelSpec.from_config(cfg)
    spec = DraftModelSpec.from_config(draft_config())
    with pytest.raises(ConfigError, match=r"draft hidden_size \(32\) != target hidden_size \(64\)"):
        check_against_target(spec, hidden_size=64, num_layers=3, vocab_size=VOCAB)
    with pytest.raises(ConfigError, match=r"target_layer_ids \[2\] outside the target's 2 layers"):
        check_against_target(spec, hidden_size=H, num_layers=2, vocab_size=VOCAB)


def test_speculative_generate_is_lossless_with_a_random_draft():
    target, draft = tiny_target(2), make_draft(seed=6)
    prompt, n = [3, 9, 27, 1, 40, 12], 20
    out = speculative_generate(target, draft, prompt, n)
    want = hf_greedy(target, prompt, n)
    assert out.tokens == want
    assert all(0 <= a <= draft.block_size - 1 for a in out.accept_lens)


def test_batched_extend_caches_equals_one_request_at_a_time():
    """Many requests' new rows in one fc / K/V projection land in each cache as if appended alone."""
    draft = make_draft(seed=3)
    K = draft.spec.num_target_features
    gen = torch.Generator().manual_seed(7)
    steps = [[5, 0, 3], [2, 4, 1]]  # rows per request per step, a request with none included
    alone = [new_cache(draft) for _ in range(3)]
    batched = [new_cache(draft) for _ in range(3)]
    for lens in steps:
        feats = [torch.randn(n, K * H, generator=gen) for n in lens]
        for cache, f in zip(alone, feats):
            extend_caches(draft, [cache], [f])
        extend_caches(draft, batched, feats)
    for a, b in zip(alone, batched):
        assert a.length == b.length
        for layer in range(draft.spec.num_layers):
            (ka, va), (kb, vb) = a.kv(layer), b.kv(layer)
            torch.testing.assert_close(kb, ka, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(vb, va, rtol=1e-5, atol=1e-6)


def test_hash_routed_draft_routes_by_the_block_token_ids(tmp_path):
    """A draft whose first layer is hash-routed: the block's ids reach it (cached == uncached with the
    same ids), it needs them in the uncached forward, round-trips an export and decodes losslessly."""
    cfg = draft_config(num_hash_layers=1)
    draft = make_draft(seed=8, num_hash_layers=1)
    assert [layer.token_routed for layer in draft.layers] == [True, False]
    heads, gen = Heads(), torch.Generator().manual_seed(4)
    feats = [torch.randn(n, 2 * H, generator=gen) for n in (3, 6)]
    caches = []
    for f in feats:
        caches.append(new_cache(draft))
        extend_caches(draft, [caches[-1]], [f])
    anchors = torch.tensor([4, 19])
    got = reference_hidden(draft, caches, anchors, heads)[0]
    B = draft.block_size
    for i, f in enumerate(feats):
        ids = torch.tensor([int(anchors[i])] + [draft.spec.mask_token_id] * (B - 1))
        L = f.shape[0]
        with torch.no_grad():
            want = draft(heads.embed(ids).unsqueeze(0), torch.arange(L, L + B).unsqueeze(0),
                         draft.fuse_features(f).unsqueeze(0), torch.arange(L).unsqueeze(0), input_ids_NQ=ids.unsqueeze(0))
        torch.testing.assert_close(got[i], want[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="layer 0 is hash-routed"):
        draft(torch.zeros(1, B, H), torch.arange(B).unsqueeze(0), torch.zeros(1, 2, H), torch.arange(2).unsqueeze(0))
    loaded = load_draft(write_export(draft, cfg, tmp_path / "hash"))
    assert torch.equal(loaded.layers[0].mlp.router.tid2eid, draft.layers[0].mlp.router.tid2eid)
    torch.testing.assert_close(reference_hidden(loaded, caches, anchors, heads)[0], got, rtol=0, atol=0)
    target = tiny_target(2)
    prompt, n = [3, 9, 27, 1, 40, 12], 16
    out = speculative_generate(target, draft, prompt, n)
    want = hf_greedy(target, prompt, n)
    assert out.tokens == want
