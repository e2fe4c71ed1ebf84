"""The speculative-sampling walk is exact in distribution (CPU).

The target and the draft are two Markov chains over a vocabulary of 5, so the target's own
distribution of the first three generated tokens is known exactly: P(a, b, c) = T[s][a] T[a][b]
T[b][c]. 60,000 seeded requests decode through the walk (K = 2 drafts a step, the draft sampling
autoregressively from its own chain, every random number counter-based); the empirical distribution
over the 125 outcomes is held against the exact one by a chi-square goodness-of-fit test at alpha =
0.001 (threshold by the Wilson-Hilferty approximation: 178.5 for 124 degrees of freedom; the walk
scores 94.2 here). The seeds are fixed, so the test is deterministic; a verifier biased in a way
that is easy to miss (greedy acceptance, a bonus sampled from p at a rejection) fails it by a wide
margin (29,540): the test of the test.
"""

from __future__ import annotations

import math

import torch

from epdraft.sampling import Stream, greedy_probabilities, rejection_sample, sample_tokens, uniforms, verify_drafts

V, K, L, TRIALS = 5, 2, 3, 60_000
ANCHOR = 0


def chains() -> tuple[torch.Tensor, torch.Tensor]:
    """(target T, draft Q): row-stochastic [V, V] fp32, every target transition >= ~0.06 so each of
    the 125 outcomes expects >= 5 of the TRIALS."""
    gen = torch.Generator().manual_seed(7)
    target = (torch.randn(V, V, generator=gen) * 0.6).softmax(dim=-1)
    draft = (torch.randn(V, V, generator=gen) * 1.5).softmax(dim=-1)  # a different, sharper chain
    return target, draft


def chi2_threshold(df: int, z: float = 3.0902) -> float:
    """The chi-square quantile at 1 - alpha (z: the normal quantile; 3.0902 = alpha 0.001), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def decode(target: torch.Tensor, draft: torch.Tensor, verify) -> torch.Tensor:
    """The first L tokens of TRIALS requests (seed = request index) decoded speculatively from ANCHOR."""
    seeds = torch.arange(TRIALS)
    out = torch.full((TRIALS, L + K + 1), -1, dtype=torch.long)
    length = torch.zeros(TRIALS, dtype=torch.long)
    last = torch.full((TRIALS,), ANCHOR, dtype=torch.long)
    while bool((length < L).any()):
        prev, drafts, q = last, [], []
        for i in range(K):  # the draft samples autoregressively from its own chain
            q.append(draft[prev])
            prev = sample_tokens(draft[prev], uniforms(seeds, length + i, Stream.DRAFT))
            drafts.append(prev)
        draft_NK, q_NKV = torch.stack(drafts, dim=1), torch.stack(q, dim=1)
        p_NKV = torch.stack([target[last]] + [target[d] for d in drafts], dim=1)  # target given each prefix
        accepted, token = verify(draft_NK, q_NKV, p_NKV, seeds, length)
        active = length < L
        for j in range(K + 1):
            value = torch.where(j < accepted, draft_NK[:, min(j, K - 1)], token)
            write = active & (j <= accepted)
            out[write, (length + j)[write]] = value[write]
        length = torch.where(active, length + accepted + 1, length)
        last = torch.where(active, token, last)
    return out[:, :L]


def chi2(tokens: torch.Tensor, target: torch.Tensor) -> float:
    cells = (tokens[:, 0] * V + tokens[:, 1]) * V + tokens[:, 2]
    observed = torch.bincount(cells, minlength=V**3).double()
    a, b, c = torch.meshgrid(torch.arange(V), torch.arange(V), torch.arange(V), indexing="ij")
    exact = (target[ANCHOR][a] * target[a, b] * target[b, c]).double().flatten()
    expected = exact * TRIALS
    assert float(expected.min()) >= 5  # the approximation's rule of thumb
    return float(((observed - expected) ** 2 / expected).sum())


def biased_verify(draft_NK, q_NKV, p_NKV, seed_N, start_N):
    """Greedy acceptance (keep a draft when it is the target's argmax) with tokens sampled from p."""
    accept = draft_NK == p_NKV[:, :K].argmax(dim=-1)
    accepted = accept.long().cumprod(dim=-1).sum(dim=-1)
    p_n = p_NKV.gather(1, accepted.view(-1, 1, 1).expand(-1, 1, V)).squeeze(1)
    return accepted, sample_tokens(p_n, uniforms(seed_N, start_N + accepted, Stream.TARGET))


def test_the_walk_samples_the_targets_distribution():
    target, draft = chains()
    tokens = decode(target, draft, verify_drafts)
    assert bool((tokens >= 0).all())
    assert chi2(tokens, target) < chi2_threshold(V**3 - 1)


def test_a_biased_verifier_fails_the_same_test():
    target, draft = chains()
    assert chi2(decode(target, draft, biased_verify), target) > 3 * chi2_threshold(V**3 - 1)


def test_the_draft_is_accepted_at_its_expected_rate():
    """One step from the anchor: P(first draft accepted) = sum_x min(p(x), q(x)) exactly in
    expectation; 60,000 trials put the observed rate within 4.5 standard errors."""
    target, draft = chains()
    seeds = torch.arange(TRIALS)
    q = draft[ANCHOR].expand(TRIALS, 1, V)
    x = sample_tokens(q[:, 0], uniforms(seeds, torch.zeros(TRIALS, dtype=torch.long), Stream.DRAFT)).unsqueeze(1)
    p = torch.stack([target[ANCHOR].expand(TRIALS, V), target[x[:, 0]]], dim=1)
    accepted, _ = verify_drafts(x, q, p, seeds, torch.zeros(TRIALS, dtype=torch.long))
    rate = float(torch.minimum(target[ANCHOR], draft[ANCHOR]).sum())
    assert abs(float(accepted.double().mean()) - rate) < 4.5 * math.sqrt(rate * (1 - rate) / TRIALS)


def test_greedy_rows_accept_exactly_the_target_argmax():
    """One-hot p and q (temperature 0): drafts are kept while they equal the target's argmax, and the
    token after them is the argmax, whatever the random numbers."""
    gen = torch.Generator().manual_seed(4)
    N, Kd, Vd = 64, 4, 11
    target_logits = torch.randn(N, Kd + 1, Vd, generator=gen)
    draft_NK = torch.where(torch.rand(N, Kd, generator=gen) < 0.7, target_logits[:, :Kd].argmax(-1),
                           torch.randint(0, Vd, (N, Kd), generator=gen))  # fmt: skip
    q = torch.nn.functional.one_hot(draft_NK, Vd).float()
    p = greedy_probabilities(target_logits)
    accepted, token = rejection_sample(draft_NK, q, p, torch.rand(N, Kd, generator=gen, dtype=torch.float64),
                                       torch.rand(N, Kd + 1, generator=gen, dtype=torch.float64))  # fmt: skip
    argmax = target_logits.argmax(-1)
    for n in range(N):
        want = next((i for i in range(Kd) if draft_NK[n, i] != argmax[n, i]), Kd)
        assert int(accepted[n]) == want and int(token[n]) == int(argmax[n, want])


def test_sample_tokens_is_the_inverse_cdf():
    """On an evenly spaced grid of u, each token's share is its probability to within the grid step,
    and a token of probability 0 is never drawn."""
    probs = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.125, 0.125, 0.0])
    M = 8000
    u = (torch.arange(M, dtype=torch.float64) + 0.5) / M
    counts = torch.bincount(sample_tokens(probs.expand(M, -1), u), minlength=probs.numel())
    assert torch.equal(counts, (probs * M).long())


def test_a_request_draws_the_same_numbers_in_any_batch():
    """Counter-based: a (seed, position) pair gives one number, whoever else is in the batch."""
    alone = uniforms(torch.tensor([42]), torch.tensor([17]), Stream.ACCEPT)
    batch = uniforms(torch.tensor([3, 42, 9]), torch.tensor([17, 17, 2]), Stream.ACCEPT)
    assert torch.equal(alone[0], batch[1])
    assert not torch.equal(batch[1], uniforms(torch.tensor([42]), torch.tensor([17]), Stream.TARGET)[0])
    u = uniforms(torch.arange(100_000), torch.tensor(5), Stream.DRAFT)
    assert float(u.min()) >= 0 and float(u.max()) < 1
    counts = torch.histc(u.float(), bins=20, min=0, max=1)
    assert chi2_for_uniform(counts) < chi2_threshold(19)


def chi2_for_uniform(counts: torch.Tensor) -> float:
    expected = counts.sum() / counts.numel()
    return float(((counts - expected) ** 2 / expected).sum())
