"""The sampling probabilities against transformers' own logits warpers, row by row (CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from epdraft.sampling import greedy_probabilities, probabilities

V = 50


def hf_probabilities(logits_V: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """What transformers' generate samples from: its warpers in its order, then softmax."""
    scores = logits_V.unsqueeze(0).float()
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    for warp in warpers:
        scores = warp(None, scores)
    return scores.softmax(dim=-1)[0]


SETTINGS = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.9), (0.5, 10, 0.8), (1.0, 1, 1.0), (2.0, 0, 0.3),
            (0.9, 60, 0.95), (1.0, 3, 0.5)]  # fmt: skip


def test_each_row_equals_transformers_warpers():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(SETTINGS), V, generator=gen) * 3
    temperature = torch.tensor([s[0] for s in SETTINGS])
    top_k = torch.tensor([s[1] for s in SETTINGS])
    top_p = torch.tensor([s[2] for s in SETTINGS])
    got = probabilities(logits, temperature, top_k, top_p)
    for i, (t, k, p) in enumerate(SETTINGS):
        torch.testing.assert_close(got[i], hf_probabilities(logits[i], t, k, p), rtol=1e-6, atol=1e-7)
        assert (got[i] > 0).sum() == (hf_probabilities(logits[i], t, k, p) > 0).sum()  # the same kept set


def test_a_request_settings_apply_to_every_position_of_its_block():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, V, generator=gen)  # [N, B, V]
    got = probabilities(logits, torch.tensor([0.8, 1.2]).unsqueeze(1), torch.tensor([4, 0]).unsqueeze(1),
                        torch.tensor([1.0, 0.7]).unsqueeze(1))  # fmt: skip
    for b in range(4):
        torch.testing.assert_close(got[0, b], hf_probabilities(logits[0, b], 0.8, 4, 1.0), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got[1, b], hf_probabilities(logits[1, b], 1.2, 0, 0.7), rtol=1e-6, atol=1e-7)


def test_temperature_zero_is_the_one_hot_argmax_whatever_top_k_and_top_p():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    got = probabilities(logits, torch.zeros(3), torch.tensor([0, 2, 7]), torch.tensor([1.0, 0.5, 0.1]))
    assert torch.equal(got, greedy_probabilities(logits))
    assert torch.equal(got.argmax(dim=-1), logits.argmax(dim=-1)) and torch.equal(got.sum(dim=-1), torch.ones(3))


@pytest.mark.parametrize("top_p", [1e-6, 0.2])
def test_top_p_keeps_the_most_likely_token_at_least(top_p):
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(3))
    got = probabilities(logits, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.tensor([top_p]))
    assert got[0, logits.argmax()] > 0 and torch.isclose(got.sum(), torch.tensor(1.0))
