"""Logits -> the probabilities a request samples from: temperature, then top-k, then top-p.

Each row has its own parameters (tensors, so a batch of requests with different settings is one
call and a CUDA graph can hold it). The order and the tie rules are transformers' logits warpers
(`TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper` with min_tokens_to_keep = 1),
which tests/sampling holds these against: top-k keeps every token whose scaled logit is >= the k-th
largest; top-p drops, from the least likely up, the tokens whose cumulative probability stays
<= 1 - top_p (the most likely token always stays). Rows of temperature 0 are greedy: a one-hot of
the argmax, so the rejection walk accepts exactly the target's argmax (bit-lossless).
"""

from __future__ import annotations

import torch


def greedy_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """One-hot [..., V] fp32 of the argmax of `logits` [..., V] (ties: the first, as torch.argmax)."""
    out = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def probabilities(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, *, filtered: bool = True
) -> torch.Tensor:
    """Sampling probabilities [..., V] fp32 of `logits` [..., V].

    temperature [...] float (0 = greedy), top_k [...] int (0 = no top-k; more than V = V), top_p
    [...] float in (0, 1] (1 = no top-p), broadcast against the leading dims of `logits` (a
    request's settings apply to every position of its block). Computed in fp32. `filtered`
    False: the caller knows no row has top-k or top-p (`Readout.SAMPLE`), so the two sorts over
    the vocabulary they need are skipped.
    """
    temperature = temperature.to(logits.device)
    greedy = temperature == 0
    scaled = logits.float() / torch.where(greedy, torch.ones_like(temperature), temperature).float().unsqueeze(-1)
    if filtered:
        scaled = _top_k_top_p(scaled, top_k.to(logits.device), top_p.to(logits.device))
    sampled = scaled.softmax(dim=-1)
    return torch.where(greedy.unsqueeze(-1), greedy_probabilities(logits), sampled)


def _top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`scaled` with -inf outside each row's top-k, then outside its top-p nucleus."""
    V = scaled.shape[-1]
    descending = scaled.sort(dim=-1, descending=True).values
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).clamp(1, V).long()
    kth = descending.gather(-1, (k - 1).unsqueeze(-1).expand(*scaled.shape[:-1], 1))
    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    ascending, order = scaled.sort(dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p.float()).unsqueeze(-1)
    drop[..., -1] = False  # the most likely token always stays
    return scaled.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
