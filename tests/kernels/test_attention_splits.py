"""The block attention's key splits (host side; the kernel itself: tests/gpu/test_draft_step.py)."""

from __future__ import annotations

import pytest

from epdraft.kernels.step import attention


@pytest.mark.parametrize("requests", [1, 2, 8, 32, 33, 64, 200])
@pytest.mark.parametrize("capacity", [16, 300, 1040, 8208])
def test_key_splits_fill_one_wave_and_none_is_short(requests, capacity):
    kv_heads = 8
    splits = attention.num_splits_for(requests, kv_heads, capacity)
    pairs = requests * kv_heads
    assert splits >= 1
    assert pairs * splits <= max(pairs, attention._TARGET_PROGRAMS)  # never a second, straggling wave
    assert splits == 1 or -(-capacity // splits) >= attention._MIN_SPLIT_KEYS / 2  # splits of useful length
    more = splits + 1
    assert pairs * more > attention._TARGET_PROGRAMS or more > -(-capacity // attention._MIN_SPLIT_KEYS)


def test_eight_requests_at_8k_take_four_splits_not_five():
    """The case measured on the H200: 64 (request, KV head) pairs, 264 slots -> 4 splits (256 programs)."""
    assert attention.num_splits_for(8, 8, 8208) == 4
