"""The speculative-sampling walk: draft tokens in, tokens distributed exactly as the target's own
sampling out (Leviathan et al. 2023; Chen et al. 2023).

For each request, draft token x_i (sampled from the draft's q_i) is accepted with probability
min(1, p_i(x_i) / q_i(x_i)), in order; at the first rejection the target's token is sampled from
normalize(max(0, p_i - q_i)), and if every draft is accepted the bonus from p_K. Every output
token is then distributed as the target's p given the tokens before it. With one-hot p and q
(greedy rows) the walk accepts a draft exactly when it is the target's argmax, and the token after
is the argmax: bit-lossless. Batched over requests as tensor ops, no host sync.
"""

from __future__ import annotations

import dataclasses

import torch

from epdraft.sampling.batch import SamplingBatch
from epdraft.sampling.counter_rng import Stream, uniforms


def sample_tokens(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens [...] int64 drawn from `probs` [..., V] (non-negative, any positive total) by the
    inverse CDF at `u` [...] in [0, 1): token t with probability probs[t] / sum(probs), never a
    token of probability 0. fp64 cumulative sums, so a small probability keeps its share."""
    cdf = probs.double().cumsum(dim=-1)
    point = (u.double() * cdf[..., -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, point, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def rejection_sample(
    draft_NK: torch.Tensor,
    q_NKV: torch.Tensor,
    p_NKV: torch.Tensor,
    accept_u_NK: torch.Tensor,
    target_u_NK: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One verify step's walk for N requests with K drafts each.

    Args:
        draft_NK: [N, K] int64 draft tokens, x_i sampled from q_NKV[:, i].
        q_NKV: [N, K, V] the draft's probabilities each token was sampled from.
        p_NKV: [N, K + 1, V] the target's probabilities at the K draft positions and the bonus one.
        accept_u_NK: [N, K] uniforms in [0, 1) of the accept tests.
        target_u_NK: [N, K + 1] uniforms of the target's token at each position (the one at the
            first rejection, or the bonus, is used).
    Returns:
        (accepted [N] int64 in 0..K: the leading drafts kept, token [N] int64: the target's token
        after them). The request's new tokens are draft_NK[n, :accepted[n]] then token[n].
    """
    N, K = draft_NK.shape
    if K == 0:
        return draft_NK.new_zeros(N), sample_tokens(p_NKV[:, 0], target_u_NK[:, 0])
    V = p_NKV.shape[-1]
    x = draft_NK.unsqueeze(-1)
    p_x = p_NKV[:, :K].gather(-1, x).squeeze(-1).double()
    q_x = q_NKV.gather(-1, x).squeeze(-1).double()
    accept = accept_u_NK.double() * q_x < p_x  # u < p/q without a division (q_x > 0: x was drawn from q)
    accepted = accept.long().cumprod(dim=-1).sum(dim=-1)
    at = accepted.view(N, 1, 1).expand(N, 1, V)
    p_n = p_NKV.gather(1, at).squeeze(1).double()
    q_n = q_NKV.gather(1, at.clamp(max=K - 1)).squeeze(1).double()
    residual = (p_n - q_n).clamp(min=0.0)
    # p == q at the rejected position cannot reject: an all-zero residual is rounding, sample p then
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_n)
    dist = torch.where((accepted < K).unsqueeze(-1), residual, p_n)
    u = target_u_NK.gather(1, accepted.unsqueeze(1)).squeeze(1)
    return accepted, sample_tokens(dist, u)


def verify_drafts(
    draft_NK: torch.Tensor, q_NKV: torch.Tensor, p_NKV: torch.Tensor, seed_N: torch.Tensor, start_N: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rejection_sample` with each request's counter-based uniforms: draft token i of request n
    sits at sequence position start_N[n] + i, and its accept test and the target's token there use
    (seed_N[n], that position). Same returns."""
    K = draft_NK.shape[1]
    positions = start_N.long().unsqueeze(1) + torch.arange(K + 1, device=draft_NK.device)
    seed = seed_N.long().unsqueeze(1)
    accept_u = uniforms(seed, positions[:, :K], Stream.ACCEPT)
    target_u = uniforms(seed, positions, Stream.TARGET)
    return rejection_sample(draft_NK, q_NKV, p_NKV, accept_u, target_u)


def greedy_accept(blocks_NB: torch.Tensor, target_pred_NB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy verify rule (SGLang `compute_dflash_accept_len_and_bonus`).

    blocks_NB: [N, B] candidates, column 0 the anchor; target_pred_NB: [N, B] the target's argmax
    after each candidate row. Returns (accept_lens [N] in 0..B-1, bonus [N]), both int64.
    """
    matches = blocks_NB[:, 1:] == target_pred_NB[:, :-1]
    accept_lens = matches.to(torch.int64).cumprod(dim=1).sum(dim=1)
    bonus = target_pred_NB.gather(1, accept_lens.unsqueeze(1)).squeeze(1)
    return accept_lens, bonus


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One verify step's outcome for N requests with K drafts each (all on the logits' device).

    accept_lens [N] int64: leading drafts kept. next_tokens [N] int64: the target's token after
    them (the next anchor). overlap_NK [N, K] fp32: sum_x min(p_i(x), q_i(x)), the probability that
    draft i is accepted given the tokens before it (1 or 0 on a greedy row); only the positions up
    to the first rejection were tested (`tested`), so only those say what the draft could reach.
    """

    accept_lens: torch.Tensor
    next_tokens: torch.Tensor
    overlap_NK: torch.Tensor

    @property
    def tested(self) -> torch.Tensor:
        """[N] int64: positions whose accept test ran (the accepted ones and the first rejected)."""
        return (self.accept_lens + 1).clamp(max=self.overlap_NK.shape[1])

    def overlap_sum(self) -> torch.Tensor:
        """[N] fp32: the overlap summed over the tested positions (expected accepts of those tests)."""
        K = self.overlap_NK.shape[1]
        mask = torch.arange(K, device=self.overlap_NK.device) < self.tested.unsqueeze(1)
        return (self.overlap_NK * mask).sum(dim=1)


def speculative_accept(
    blocks_NB: torch.Tensor,
    target_logits_NBV: torch.Tensor,
    batch: SamplingBatch,
    draft_probs_NKV: torch.Tensor | None,
    start_N: torch.Tensor,
) -> Verdict:
    """The verify rule for N requests of mixed sampling settings, as an engine that verifies
    itself calls it (no host sync; shapes fixed by the batch).

    blocks_NB: [N, K + 1] the anchor then K drafts. target_logits_NBV: the target's logits after
    each block row. batch: each request's sampling (an all-greedy batch takes the argmax rule,
    bit-equal to greedy decoding, and needs no draft probabilities). draft_probs_NKV: [N, K, V]
    the draft's proposal probabilities each draft was sampled from (`DraftStep.probs_NKV`;
    one-hot rows for greedy requests). start_N: [N] int64, each anchor's sequence position (the
    request's committed length): draft i decides position start + 1 + i, and the random numbers
    of that decision are keyed by (seed, position).
    """
    drafts_NK = blocks_NB[:, 1:]
    if batch.greedy:
        pred_NB = target_logits_NBV.argmax(dim=-1)
        accept, bonus = greedy_accept(blocks_NB, pred_NB)
        return Verdict(accept, bonus, (drafts_NK == pred_NB[:, :-1]).float())
    if draft_probs_NKV is None:
        raise ValueError("a batch with sampled requests needs the draft's proposal probabilities (draft_probs_NKV)")
    p_NBV = batch.probabilities(target_logits_NBV)
    q_NKV = draft_probs_NKV.to(p_NBV.device, torch.float32)
    K = drafts_NK.shape[1]
    overlap = torch.minimum(p_NBV[:, :K], q_NKV).sum(dim=-1)
    accept, token = verify_drafts(drafts_NK, q_NKV, p_NBV, batch.seed, start_N.to(p_NBV.device) + 1)
    return Verdict(accept, token, overlap)
