"""KVPool: admission, refusal when full (naming the key), release and reuse; and the pooled draft
step equals the cache-based one (the eager reference) on the tiny trained draft."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from epdraft.errors import RequestError
from epdraft.models import load_draft, read_draft_spec
from epdraft.models.kv_pool import KVPool
from epdraft.models.reference import extend_caches, new_cache, reference_step

ASSETS = Path(__file__).resolve().parents[2] / "epdraft" / "assets"


def _pool(max_requests=2, max_context=10) -> KVPool:
    return KVPool(2, 1, 4, max_requests=max_requests, max_context=max_context, block_size=3, dtype=torch.float32, device="cpu")


def test_admission_refusal_release_and_reuse():
    pool = _pool()
    assert pool.k[0].shape == (3, 1, 13, 4)  # max_requests + the pad slot, max_context + B rows
    a, b = pool.admit(7), pool.admit(8)
    assert {a, b} == {0, 1} and pool.pad_slot == 2 and len(pool) == 2
    with pytest.raises(RequestError, match=r"request 9: the KV pool is full, 2 requests active \(draft.max_requests = 2\)"):
        pool.admit(9)
    with pytest.raises(RequestError, match="request 7 is already active"):
        pool.admit(7)
    rows = torch.arange(2 * 4, dtype=torch.float32).view(1, 2, 4)
    slot_T, position_T = pool.placement(torch.tensor([b]), torch.tensor([2]), 2)
    pool.store(0, slot_T, position_T, rows.transpose(0, 1), -rows.transpose(0, 1))
    pool.advance(torch.tensor([b]), torch.tensor([2]))
    pool.book(8, 2)
    with pytest.raises(RequestError, match=r"request 8: 2 \+ 9 context rows exceed draft.max_context = 10"):
        pool.check_room(8, 9)
    pool.release(7)
    assert 7 not in pool and pool.lengths[a] == 0
    assert pool.admit(9) == a  # the freed slot is reused ...
    assert torch.equal(pool.k[0][b, :, :2], rows) and pool.length(8) == 2  # ... and 8's rows are untouched
    assert pool.lengths.tolist() == ([0, 2, 0] if b == 1 else [2, 0, 0])
    with pytest.raises(RequestError, match="request 5 has no KV pool slot"):
        pool.slot(5)


def test_pooled_step_equals_the_cache_reference():
    spec = read_draft_spec(ASSETS / "tiny-draft")
    from epdraft.target.hf import HFTarget

    target = HFTarget.from_pretrained(ASSETS / "tiny-target", spec.target_layer_ids)
    draft = load_draft(ASSETS / "tiny-draft", spec=spec)
    gen = torch.Generator().manual_seed(0)
    width = spec.num_target_features * spec.hidden_size
    features = [torch.randn(n, width, generator=gen) for n in (5, 17, 1)]
    more = [torch.randn(n, width, generator=gen) for n in (3, 1, 6)]
    caches = [new_cache(draft) for _ in features]
    pool = draft.new_pool(max_requests=5, max_context=40)
    rids = [30, 10, 20]
    for rid in rids:
        pool.admit(rid)
    for batch in (features, more):  # two extensions: the second appends after the first's rows
        extend_caches(draft, caches, batch)
        draft.extend(pool, rids, batch)
    anchors = torch.tensor([3, 7, 11])
    slots = torch.tensor([pool.slot(r) for r in rids])
    assert torch.equal(draft.step(pool, slots, anchors, target, None).drafts_NK, reference_step(draft, caches, anchors, target).drafts_NK)
    # The slot order does not matter, and a request alone sees only its own context.
    order = [2, 0, 1]
    alone = draft.step(pool, slots[order], anchors[order], target, None).drafts_NK
    assert torch.equal(alone, reference_step(draft, [caches[i] for i in order], anchors[order], target).drafts_NK)
    assert pool.length(10) == 18 and pool.length(20) == 7


VARIANTS = {
    "sliding-2-hash-rnn-autoregressive": ["--sliding-window", "2", "--hash-layers", "1", "--markov", "rnn", "--autoregressive"],
    "sliding-9-gated": ["--sliding-window", "9", "--markov", "gated"],
    "vanilla-two-hash": ["--markov", "vanilla", "--hash-layers", "2"],
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_pooled_step_equals_the_cache_reference_for_every_variant(variant, tmp_path):
    import subprocess
    import sys

    from epdraft.target.hf import HFTarget

    repo = ASSETS.parents[1]
    subprocess.run([sys.executable, str(repo / "tools" / "make_variant_draft.py"), str(tmp_path), *VARIANTS[variant]],
                   check=True, capture_output=True)  # fmt: skip
    spec = read_draft_spec(tmp_path / "draft")
    target = HFTarget.from_pretrained(ASSETS / "tiny-target", spec.target_layer_ids)
    draft = load_draft(tmp_path / "draft", spec=spec)
    gen = torch.Generator().manual_seed(3)
    width = spec.num_target_features * spec.hidden_size
    caches = [new_cache(draft) for _ in range(3)]
    pool = draft.new_pool(max_requests=3, max_context=64)
    for rid in range(3):
        pool.admit(rid)
    for lens in ((1, 12, 4), (2, 1, 9)):  # contexts shorter and longer than the window and the block
        batch = [torch.randn(n, width, generator=gen) for n in lens]
        extend_caches(draft, caches, batch)
        draft.extend(pool, [0, 1, 2], batch)
        anchors = torch.randint(0, spec.vocab_size - 1, (3,), generator=gen)
        slots = torch.tensor([pool.slot(r) for r in range(3)])
        expected = reference_step(draft, caches, anchors, target).drafts_NK
        assert expected.shape == (3, spec.num_drafts)
        assert torch.equal(draft.step(pool, slots, anchors, target, None).drafts_NK, expected)


def test_set_length_moves_host_and_device_lengths_within_max_context():
    pool = _pool()
    a = pool.admit(3)
    pool.set_length(3, 7)
    assert pool.length(3) == 7 and pool.lengths[a] == 7
    pool.set_length(3, 2)  # a rollback
    assert pool.length(3) == 2 and pool.lengths[a] == 2
    with pytest.raises(RequestError, match=r"request 3: context length 11 outside \[0, draft.max_context = 10\]"):
        pool.set_length(3, 11)
    with pytest.raises(RequestError, match="request 4 has no KV pool slot"):
        pool.set_length(4, 1)
