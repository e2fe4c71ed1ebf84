"""The exact reference of tests/sampling/exact.py, tested itself (the test of the test).

Compared: the enumerated distribution of the tiny target's first three tokens after
`reference_prompt()` against 4,000 plain ancestral decodes of the HF model (transformers' warpers,
torch.multinomial), by Pearson's chi-square at alpha = 1e-4: at T = 1.0 (full vocabulary) and at
T = 0.7 with top_k = 5. A sampler that is wrong in a way a speculative verifier can be (a slightly
cooler temperature, a greedy first token) must fail the same test. Every draw comes from a
torch.Generator with a fixed seed and the reference is computed, not sampled, so each test gives the
same statistic on every run: alpha bounds the chance that a change of seed, model or torch version
makes a correct sampler fail (1 in 10,000 per comparison), not flakiness.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tests.sampling.exact import (
    chi_square,
    chi_square_threshold,
    load_target,
    next_token_logits,
    reference_prompt,
    tiny_reference,
    warped_probabilities,
)

N = 4000


def ancestral_counts(temperatures: tuple[float, ...], top_k: int | None, seed: int) -> Counter:
    """Counts of the first len(temperatures) tokens of N ancestral decodes of the target: token i
    drawn by torch.multinomial from the warped probabilities at temperatures[i] (0: the argmax)."""
    gen = torch.Generator().manual_seed(seed)
    tokens_NL = torch.zeros(N, 0, dtype=torch.long)
    for t in temperatures:
        logits_NV = next_token_logits(load_target(), reference_prompt(), tokens_NL)
        if t == 0:
            token_N1 = logits_NV.argmax(dim=-1, keepdim=True)
        else:
            probs_NV = warped_probabilities(logits_NV, temperature=t, top_k=top_k)
            token_N1 = torch.multinomial(probs_NV, 1, generator=gen)
        tokens_NL = torch.cat([tokens_NL, token_N1], dim=1)
    return Counter(map(tuple, tokens_NL.tolist()))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.7, 5)])
def test_probabilities_sum_to_one(temperature, top_k):
    probs = tiny_reference(temperature, top_k)
    assert math.isclose(sum(probs.values()), 1.0, abs_tol=1e-9)
    assert 0.0 <= probs[None] <= 1e-6
    assert all(len(k) == 3 and p > 0 for k, p in probs.items() if k is not None)
    if top_k is not None:
        assert len(probs) - 1 <= 5**3  # at most 5 tokens a position


def test_cached_forward_equals_full_forward():
    suffixes = torch.tensor([[5, 7], [101, 32], [259, 0]])
    cached = next_token_logits(load_target(), reference_prompt(), suffixes)
    with torch.no_grad():
        full = [load_target()(torch.tensor([reference_prompt() + s])).logits[0, -1] for s in suffixes.tolist()]
    torch.testing.assert_close(cached, torch.stack(full), atol=1e-4, rtol=1e-4)


def test_chi_square_pools_small_cells_and_rejects_impossible_draws():
    probs = {("a",): 0.5, ("b",): 0.3, ("c",): 0.15, ("d",): 0.04, None: 0.01}
    exact = {("a",): 50, ("b",): 30, ("c",): 15, ("d",): 4, ("e",): 1}
    assert chi_square(exact, probs, 100) == (0.0, 3)  # d (4) + None (1) pooled: a, b, c, pool
    assert chi_square({("a",): 100}, {("a",): 1.0}, 100) == (0.0, 0)
    assert chi_square({("a",): 99, ("z",): 1}, {("a",): 1.0}, 100) == (math.inf, 1)
    with pytest.raises(ValueError, match="counts sum to 99, expected n = 100"):
        chi_square({("a",): 99}, probs, 100)


@pytest.mark.parametrize("dof, rel", [(5, 0.023), (20, 0.006), (124, 0.001)])
def test_wilson_hilferty_threshold_is_just_above_the_exact_quantile(dof, rel):
    stats = pytest.importorskip("scipy.stats")
    exact = stats.chi2.ppf(1 - 1e-4, dof)
    assert exact < chi_square_threshold(dof) < exact * (1 + rel)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.7, 5)])
def test_ancestral_sampling_passes(temperature, top_k):
    counts = ancestral_counts((temperature,) * 3, top_k, seed=0)
    statistic, dof = chi_square(counts, tiny_reference(temperature, top_k), N)
    assert statistic < chi_square_threshold(dof), (statistic, dof, chi_square_threshold(dof))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("temperatures", [(0.9, 0.9, 0.9), (0.0, 1.0, 1.0)], ids=["cooler", "greedy-first"])
def test_wrong_sampler_fails(temperatures):
    statistic, dof = chi_square(ancestral_counts(temperatures, None, seed=0), tiny_reference(1.0, None), N)
    assert statistic > chi_square_threshold(dof), (statistic, dof, chi_square_threshold(dof))
