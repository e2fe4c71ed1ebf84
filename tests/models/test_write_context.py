"""A draft's `write_context` as a commit graph runs it (issue 33): requests padded to a bucket (pad
slot, 0 rows) and rows padded to bucket x rows-per-request leave every pool exactly as `extend` of
the real rows does, for DFlash's K/V pool and a DeepSeek DSpark draft's ring (rows past its window
included), and touch no other request's slot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from epdraft.models import load_draft, read_draft_spec
from tests.models.test_deepseek_dspark import WINDOW, make_draft

ASSETS = Path(__file__).resolve().parents[2] / "epdraft" / "assets"


def _tiny_dflash():
    return load_draft(ASSETS / "tiny-draft", spec=read_draft_spec(ASSETS / "tiny-draft"))


def _pools(draft, requests: int):
    pools = [draft.new_pool(max_requests=requests + 2, max_context=64) for _ in range(2)]
    for pool in pools:
        for rid in range(requests + 1):  # request `requests` is admitted but sits this commit out
            pool.admit(rid)
    return pools


@pytest.mark.parametrize("bucket", [3, 4], ids=["full-bucket", "padded-bucket"])
@pytest.mark.parametrize("family", ["dflash", "dspark_v4"])
@torch.no_grad()
def test_padded_write_context_equals_extend(family, bucket):
    draft = _tiny_dflash() if family == "dflash" else make_draft()
    width = draft.spec.num_target_features * draft.spec.hidden_size
    gen = torch.Generator().manual_seed(5)
    eager, padded = _pools(draft, 3)
    rids = [0, 1, 2]
    # Two commits: a prompt longer than the ring, then 1..B rows each, as verify commits them.
    for counts in ((WINDOW + 3, 2, 1), (1, draft.block_size, 3)):
        rows = [torch.randn(n, width, generator=gen) for n in counts]
        draft.extend(eager, rids, rows)
        per_request = max(counts) + 2
        slots_N = torch.tensor([padded.slot(r) for r in rids] + [padded.pad_slot] * (bucket - len(rids)))
        counts_N = torch.tensor(list(counts) + [0] * (bucket - len(rids)))
        features_TF = torch.randn(bucket * per_request, width, generator=gen)  # the padding: junk rows
        features_TF[: sum(counts)] = torch.cat(rows)
        draft.write_context(padded, slots_N, counts_N, features_TF)
        for rid, n in zip(rids, counts):
            padded.book(rid, n)
        assert padded.lengths.tolist() == eager.lengths.tolist()
        assert [padded.length(r) for r in rids] == [eager.length(r) for r in rids]
    live = [eager.slot(r) for r in range(4)]  # the three that committed and the one that did not
    for got, want in zip(padded.buffers, eager.buffers):
        torch.testing.assert_close(got[live], want[live])
    assert all(not t[eager.slot(3)].any() for t in padded.buffers)  # untouched: still the zeros it started as
    assert padded.lengths[padded.pad_slot] == 0


def test_placement_sends_padding_and_rows_past_the_ring_to_the_pad_slot():
    """On a GPU, rows written to one place by one index_put land in no defined order: every kept row
    must have a place of its own, and everything else must go to the pad slot."""
    pool = make_draft().new_pool(max_requests=3, max_context=64)
    for rid in range(3):
        pool.admit(rid)
    pool.lengths[pool.slot(1)] = 6
    counts = [WINDOW + 4, 3, 0]
    slots_N = torch.tensor([pool.slot(r) for r in range(3)])
    slot_T, position_T = pool.placement(slots_N, torch.tensor(counts), sum(counts) + 5)
    kept = slot_T != pool.pad_slot
    assert kept.tolist() == [False] * 4 + [True] * (WINDOW + 3) + [False] * 5
    assert position_T[kept].tolist() == list(range(4, WINDOW + 4)) + [6, 7, 8]
    rings = set(zip(slot_T[kept].tolist(), (position_T[kept] % WINDOW).tolist()))
    assert len(rings) == int(kept.sum())
    assert not position_T[~kept].any()
