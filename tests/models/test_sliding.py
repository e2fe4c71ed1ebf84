"""Sliding-window draft layers: the block's mask is SpecForge's training mask, the trimmed cache
changes nothing, transformers' sliding-window mask agrees where the two definitions coincide."""

import pytest
import torch

from epdraft.errors import ConfigError
from epdraft.models import DFlashDraft, DraftModelSpec, speculative_generate
from epdraft.models.cache import MIN_CAPACITY, context_mask
from epdraft.models.reference import extend_caches, new_cache, reference_hidden
from tests.models.helpers import H, draft_config, hf_greedy, randomize, tiny_target
from tests.models.test_dflash import Heads, naive_attention

TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
B = 5


def specforge_block_mask(ctx_len: int, block_size: int, window: int | None) -> torch.Tensor:
    """allowed [B, ctx_len + B] of one block anchored at position ctx_len, written from SpecForge's
    `create_dflash_block_mask`: context strictly before the anchor (and, sliding, kv >= anchor + q - (W-1)),
    the own block whole (sliding: kv block offset <= q block offset)."""
    allowed = torch.zeros(block_size, ctx_len + block_size, dtype=torch.bool)
    anchor = ctx_len
    for q in range(block_size):
        for kv in range(ctx_len + block_size):
            if kv < ctx_len:
                ok = kv < anchor and (window is None or kv >= anchor + q - (window - 1))
            else:
                ok = window is None or kv - ctx_len <= q
            allowed[q, kv] = ok
    return allowed


def make(window: int, seed=0, types=TYPES, **kw) -> DFlashDraft:
    draft = DFlashDraft(DraftModelSpec.from_config(draft_config(block_size=B, layer_types=types, sliding_window=window, **kw)))
    randomize(draft, seed)
    return draft.eval()


def fill(draft, lens, seed=3, chunks=(7, 1, 3, 2, 5)):
    """Caches whose contexts arrive in chunks of varying size (prefill, then verifies: a chunk above or
    below W-1 takes each branch of the compaction), plus the features to rebuild them."""
    gen = torch.Generator().manual_seed(seed)
    feats = [torch.randn(n, 2 * H, generator=gen) for n in lens]
    caches = []
    for f in feats:
        c, start, i = new_cache(draft), 0, 0
        while start < f.shape[0]:
            extend_caches(draft, [c], [f[start:start + chunks[i % len(chunks)]]])
            start, i = start + chunks[i % len(chunks)], i + 1
        caches.append(c)
    return caches, feats


@pytest.mark.parametrize("window", [1, 2, 3, 6, 200])  # shorter than the block, than the context, longer than all
@pytest.mark.parametrize("moe", [True, False])
def test_cached_batched_propose_equals_specforge_masked_forward(window, moe):
    draft, heads = make(window, moe=moe), Heads()
    lens = (7, 2, 150, 0)  # 150 rows: the sliding buffers compact several times (capacity 2(W-1) or MIN_CAPACITY)
    caches, feats = fill(draft, lens)
    anchors = torch.tensor([4, 11, 30, 8])
    got = reference_hidden(draft, caches, anchors, heads)[0]
    for i, f in enumerate(feats):
        L = f.shape[0]
        ids = torch.tensor([int(anchors[i])] + [draft.spec.mask_token_id] * (B - 1))
        with torch.no_grad():
            want = draft(heads.embed(ids).unsqueeze(0), torch.arange(L, L + B).unsqueeze(0),
                         draft.fuse_features(f).unsqueeze(0), torch.arange(L).unsqueeze(0),
                         specforge_block_mask(L, B, None).unsqueeze(0),
                         sliding_allowed_NQS=specforge_block_mask(L, B, window).unsqueeze(0))
        torch.testing.assert_close(got[i], want[0], rtol=1e-5, atol=1e-5)
    # The window matters: the same weights as all-full layers give another result on the long context.
    full = make(window, moe=moe, types=["full_attention"] * 3)
    full.load_state_dict(draft.state_dict())
    full_caches, _ = fill(full, lens)
    assert not torch.allclose(reference_hidden(full, full_caches, anchors, heads)[0][2], got[2], atol=1e-3)


def test_sliding_layers_keep_only_their_window():
    window = 9
    draft = make(window)
    (cache,), _ = fill(draft, [300])
    assert cache.length == 300
    assert cache.rows(0) == cache.rows(2) == window - 1 and cache.rows(1) == 300
    assert cache.capacity(0) <= max(2 * (window - 1), MIN_CAPACITY) < 300 <= cache.capacity(1)
    # The kept rows are the last W-1 positions' K/V: recompute them from scratch.
    gen = torch.Generator().manual_seed(3)
    feats = torch.randn(300, 2 * H, generator=gen)
    k, v = draft.layers[0].self_attn.context_kv(draft.fuse_features(feats).unsqueeze(0), torch.arange(300).unsqueeze(0))
    ck, cv = cache.kv(0)
    torch.testing.assert_close(ck, k[0, :, -(window - 1):], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cv, v[0, :, -(window - 1):], rtol=1e-5, atol=1e-6)
    # After every append, not only at the end: each compaction keeps exactly the last W-1 positions.
    probe, done = new_cache(draft), 0
    for n in [3, 70, 1, 1, 8, 2, 60] + [1, 2, 5, 7, 3, 4] * 6:  # short chunks: compaction moves old rows forward
        extend_caches(draft, [probe], [feats[done:done + n]])
        done += n
        ck, _ = probe.kv(0)
        torch.testing.assert_close(ck, k[0, :, max(done - (window - 1), 0):done], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [5, 8])  # >= B: the two definitions coincide
def test_mask_equals_transformers_sliding_window_where_they_coincide(window):
    """For W >= B, SpecForge's in-block causal part is inside the window, so the block mask is
    transformers' `sliding_window_causal_mask_function(W)` over [context ++ block] positions."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    draft = make(window)
    caches, _ = fill(draft, (3, 12))
    fn = sliding_window_causal_mask_function(window)
    got = context_mask(caches, B, torch.device("cpu"), window)
    for i, c in enumerate(caches):
        rows, L = c.rows(0), c.length
        kv_pos = list(range(L - rows, L)) + [None] * (got.shape[2] - B - rows) + list(range(L, L + B))
        for q in range(B):
            for j, p in enumerate(kv_pos):
                assert bool(got[i, q, j]) == (p is not None and bool(fn(0, 0, torch.tensor(L + q), torch.tensor(p)))), (i, q, j)


def test_masked_attention_matches_naive_reference():
    """The boolean mask reaches the attention as "True = may attend": a per-head loop over allowed keys only."""
    draft = make(3)
    attn = draft.layers[0].self_attn
    gen = torch.Generator().manual_seed(2)
    ctx, x = torch.randn(6, H, generator=gen), torch.randn(B, H, generator=gen)
    allowed = specforge_block_mask(6, B, 3)
    k, v = attn.context_kv(ctx.unsqueeze(0), torch.arange(6).unsqueeze(0))
    got = attn(x.unsqueeze(0), torch.arange(6, 6 + B).unsqueeze(0), k, v, allowed.unsqueeze(0))[0]
    with torch.no_grad():
        want = naive_attention(attn, x, torch.arange(6, 6 + B), ctx, torch.arange(6), allowed)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_speculative_generate_is_lossless_with_a_sliding_draft():
    target, draft = tiny_target(2), make(3, seed=6)
    prompt, n = [3, 9, 27, 1, 40, 12], 20
    out = speculative_generate(target, draft, prompt, n)
    want = hf_greedy(target, prompt, n)
    assert out.tokens == want


@pytest.mark.parametrize("window, needle", [
    (0, "sliding_window = 0 must be a positive integer"),
    (-4, "sliding_window = -4 must be a positive integer"),
    ("64", "sliding_window = '64' must be a positive integer"),
    (None, "sliding_attention layers but sliding_window is missing"),
])
def test_bad_windows_are_refused(window, needle):
    with pytest.raises(ConfigError, match=needle):
        DraftModelSpec.from_config(draft_config(layer_types=TYPES, sliding_window=window))


def test_unknown_layer_type_is_refused():
    with pytest.raises(ConfigError, match=r"layer_types\[1\] = 'chunked_attention'"):
        DraftModelSpec.from_config(draft_config(layer_types=["full_attention", "chunked_attention"], sliding_window=4))
    with pytest.raises(ConfigError, match="sliding_allowed_NQS"):
        make(4)(torch.zeros(1, B, H), torch.zeros(1, B, dtype=torch.long), torch.zeros(1, 2, H), torch.zeros(1, 2, dtype=torch.long))
