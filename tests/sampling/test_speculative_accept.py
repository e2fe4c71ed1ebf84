"""`speculative_accept`, the verify rule an engine calls: the argmax rule bit for bit on an all-greedy
batch, the greedy rows of a mixed batch still greedy, the overlap sum_x min(p, q) of each draft,
and a request's verdict independent of the batch around it (its random numbers are keyed by its
seed and positions)."""

from __future__ import annotations

import pytest
import torch

from epdraft.config.sampling import SamplingParams
from epdraft.sampling import SamplingBatch, greedy_accept, probabilities, propose_tokens, speculative_accept

N, K, V = 6, 4, 11


def case(params: list[SamplingParams], seed: int = 0):
    """(blocks, target logits, batch, q, start): drafts proposed from draft logits near the target's."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(len(params), K + 1, V, generator=gen) * 2
    draft = target[:, :K] + 0.7 * torch.randn(len(params), K, V, generator=gen)
    batch = SamplingBatch.of(params)
    start = torch.arange(len(params)) * 7 + 3
    drafts, q = propose_tokens(draft, batch, start + 1)
    anchors = torch.randint(0, V, (len(params), 1), generator=gen)
    return torch.cat([anchors, drafts], dim=1), target, batch, q, start


def test_an_all_greedy_batch_is_the_argmax_rule():
    blocks, target, batch, q, start = case([SamplingParams()] * N)
    verdict = speculative_accept(blocks, target, batch, None, start)
    accept, bonus = greedy_accept(blocks, target.argmax(dim=-1))
    assert torch.equal(verdict.accept_lens, accept) and torch.equal(verdict.next_tokens, bonus)
    assert torch.equal(verdict.overlap_NK, (blocks[:, 1:] == target.argmax(dim=-1)[:, :K]).float())
    assert int(verdict.accept_lens.sum()) > 0  # some drafts equal the target's argmax


def test_greedy_rows_of_a_sampled_batch_stay_greedy_and_the_overlap_is_sum_min():
    params = [SamplingParams(temperature=1.0, seed=n) if n % 2 else SamplingParams() for n in range(N)]
    blocks, target, batch, q, start = case(params)
    verdict = speculative_accept(blocks, target, batch, q, start)
    accept, bonus = greedy_accept(blocks, target.argmax(dim=-1))
    greedy = torch.arange(N) % 2 == 0
    assert torch.equal(verdict.accept_lens[greedy], accept[greedy])
    assert torch.equal(verdict.next_tokens[greedy], bonus[greedy])
    p = probabilities(target, batch.temperature.unsqueeze(1), batch.top_k.unsqueeze(1), batch.top_p.unsqueeze(1))
    torch.testing.assert_close(verdict.overlap_NK, torch.minimum(p[:, :K], q).sum(dim=-1))
    tested = (verdict.accept_lens + 1).clamp(max=K)
    assert torch.equal(verdict.tested, tested)
    mask = torch.arange(K) < tested.unsqueeze(1)
    torch.testing.assert_close(verdict.overlap_sum(), (verdict.overlap_NK * mask).sum(dim=1))


def test_a_requests_verdict_does_not_depend_on_its_batch():
    params = [SamplingParams(temperature=0.9, top_k=5, seed=40 + n) for n in range(N)]
    blocks, target, batch, q, start = case(params)
    together = speculative_accept(blocks, target, batch, q, start)
    for n in range(N):
        alone = speculative_accept(blocks[n : n + 1], target[n : n + 1], SamplingBatch.of(params[n : n + 1]),
                                   q[n : n + 1], start[n : n + 1])  # fmt: skip
        assert int(alone.accept_lens[0]) == int(together.accept_lens[n])
        assert int(alone.next_tokens[0]) == int(together.next_tokens[n])


def test_a_sampled_batch_needs_the_draft_probabilities():
    blocks, target, batch, _, start = case([SamplingParams(temperature=1.0, seed=1)])
    with pytest.raises(ValueError, match="proposal probabilities"):
        speculative_accept(blocks, target, batch, None, start)
