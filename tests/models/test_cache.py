"""DraftCache growth and padded_context against plain concatenation / zero padding."""

import math

import torch
import torch.nn.functional as F

from epdraft.models.cache import MIN_CAPACITY, ContextScratch, DraftCache, padded_context

G, D, LAYERS = 2, 8, 3


def _rows(L: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(G, L, D, generator=gen), torch.randn(G, L, D, generator=gen)) for _ in range(LAYERS)]


def _filled(rows, chunks: list[int]) -> DraftCache:
    cache = DraftCache(LAYERS)
    for n in chunks:
        for layer, (k, v) in enumerate(rows):
            cache.append(layer, k[:, cache.length : cache.length + n], v[:, cache.length : cache.length + n])
        cache.length += n
    return cache


def test_many_appends_equal_one_append():
    L = 300
    rows = _rows(L, seed=0)
    gen = torch.Generator().manual_seed(1)
    chunks = []
    while sum(chunks) < L:
        chunks.append(min(int(torch.randint(1, 9, (1,), generator=gen)), L - sum(chunks)))
    grown, once = _filled(rows, chunks), _filled(rows, [L])
    assert grown.length == once.length == L
    for layer, (k, v) in enumerate(rows):
        for cache in (grown, once):
            ck, cv = cache.kv(layer)
            assert torch.equal(ck, k) and torch.equal(cv, v)


def test_growth_reallocates_logarithmically():
    L = 2000
    cache = _filled(_rows(L, seed=2), [1] * L)
    per_layer = cache.allocations / LAYERS
    # Doubling from MIN_CAPACITY: one allocation, then one per doubling up to L rows.
    assert per_layer == 1 + math.ceil(math.log2(L / MIN_CAPACITY))
    assert cache.capacity(0) >= L


def test_single_request_context_is_a_view():
    rows = _rows(20, seed=3)
    cache = _filled(rows, [5, 15])
    k, v = padded_context([cache], 1, rows[0][0], G, D, ContextScratch())
    assert k.shape == (1, G, 20, D) and torch.equal(k[0], rows[1][0]) and torch.equal(v[0], rows[1][1])
    assert k.untyped_storage().data_ptr() == cache.kv(1)[0].untyped_storage().data_ptr()


def test_padded_context_with_reused_scratch_equals_zero_padding():
    scratch = ContextScratch()
    for lengths in ((7, 3, 12), (2, 12, 5)):  # same Lmax: the second call reuses the first's buffers
        caches, full = [], []
        for i, L in enumerate(lengths):
            rows = _rows(L, seed=10 + i)
            caches.append(_filled(rows, [L]))
            full.append(rows)
        for layer in range(LAYERS):
            k, v = padded_context(caches, layer, full[0][0][0], G, D, scratch)
            want_k = torch.stack([F.pad(f[layer][0], (0, 0, 0, 12 - f[layer][0].shape[1])) for f in full])
            want_v = torch.stack([F.pad(f[layer][1], (0, 0, 0, 12 - f[layer][1].shape[1])) for f in full])
            assert torch.equal(k, want_k) and torch.equal(v, want_v)
            fresh_k, fresh_v = padded_context(caches, layer, full[0][0][0], G, D)
            assert torch.equal(fresh_k, want_k) and torch.equal(fresh_v, want_v)
