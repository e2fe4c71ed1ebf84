"""An exact reference for the sampling tests: the distribution of a target's first generated tokens,
and Pearson's chi-square goodness-of-fit test against it.

Independent of epdraft's sampling code: the logits are the HF model's own forward, and the sampling
semantics are transformers' logits warpers as `generate` applies them (TemperatureLogitsWarper, then
TopKLogitsWarper, then TopPLogitsWarper with min_tokens_to_keep = 1, then softmax). No end-of-sequence
stop: `epdraft run` generates max_new_tokens for every request, whatever the tokens.

The threshold is the chi-square quantile at 1 - alpha by the Wilson-Hilferty approximation (scipy is
not a test dependency; tests/sampling/test_exact_reference.py holds it against scipy where installed).
"""

from __future__ import annotations

import copy
import functools
import json
import math
from collections.abc import Hashable, Mapping
from pathlib import Path
from statistics import NormalDist

import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import epdraft
from epdraft.target.hf import cache_kwarg

ASSETS = Path(epdraft.__file__).parent / "assets"
CHUNK = 1024  # suffix rows per batched forward: each row holds its own copy of the prompt's KV


@functools.cache
def load_target() -> torch.nn.Module:
    """The tiny target (Qwen3ForCausalLM, vocabulary 260) in fp32, as `epdraft run` loads it by
    default; loaded once per test session."""
    path = ASSETS / "tiny-target"
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def reference_prompt() -> list[int]:
    """The last 16 tokens of prompt 8 of epdraft/assets/prompts.jsonl (`[events]*len(eve`).

    Its first three tokens at T = 1 have moderate entropy (about 1.4 to 1.6 nats each), so a few
    thousand draws spread over many cells of expected count >= 5 (power against a wrong sampler)
    without one sequence taking nearly all the mass; short, because the enumeration at T = 1 runs
    about 10,000 two-token prefixes, each over its own copy of the prompt's KV.
    """
    with open(ASSETS / "prompts.jsonl") as f:
        return [json.loads(line)["input_ids"] for line in f][8][-16:]


def warped_probabilities(
    logits_BV: torch.Tensor, *, temperature: float, top_k: int | None = None, top_p: float = 1.0
) -> torch.Tensor:
    """fp64 [B, V] sampling probabilities of `logits_BV` [B, V] through transformers' warpers
    (temperature > 0; top_k None = no top-k; top_p 1.0 = no top-p, as `generate` leaves them out)."""
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k is not None:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    scores = logits_BV.float()
    for warper in warpers:
        scores = warper(None, scores)  # the warpers never read input_ids
    return scores.double().softmax(dim=-1)


@torch.no_grad()
def next_token_logits(model: torch.nn.Module, prompt: list[int], suffixes_BL: torch.Tensor) -> torch.Tensor:
    """fp32 [B, V]: the model's logits after `prompt` followed by each row of `suffixes_BL` [B, L]
    int64 (L may be 0). The prompt is run once; its KV is copied for each chunk of rows."""
    kw = cache_kwarg(model)
    cache = DynamicCache(config=model.config)
    logits_1V = model(torch.tensor([prompt]), **{kw: cache}).logits[:, -1].float()
    if suffixes_BL.shape[1] == 0:
        return logits_1V.expand(suffixes_BL.shape[0], -1)
    out = []
    for rows in suffixes_BL.split(CHUNK):
        rows_cache = copy.deepcopy(cache)
        rows_cache.batch_repeat_interleave(rows.shape[0])
        out.append(model(rows, **{kw: rows_cache}).logits[:, -1].float())
    return torch.cat(out)


def exact_prefix_distribution(
    model: torch.nn.Module,
    prompt: list[int],
    *,
    n_tokens: int = 3,
    temperature: float,
    top_k: int | None = None,
    top_p: float = 1.0,
    mass: float = 1 - 1e-9,
) -> dict[tuple[int, ...] | None, float]:
    """The probability of each sequence of the first `n_tokens` tokens that ancestral sampling
    from `model` after `prompt` generates, with the warpers of `warped_probabilities`.

    Enumerated level by level in fp64; a token of probability 0 after the warpers is never
    expanded. To keep a full vocabulary tractable, at each level the least likely prefixes are
    dropped while their total stays within (1 - mass) / n_tokens; the mass dropped in all (at most
    1 - mass) is returned under the key None, so the values sum to 1 up to rounding.
    """
    budget = (1.0 - mass) / n_tokens
    prefixes_BL = torch.zeros(1, 0, dtype=torch.long)
    prob_B = torch.ones(1, dtype=torch.float64)
    dropped = 0.0
    for _ in range(n_tokens):
        p_BV = warped_probabilities(
            next_token_logits(model, prompt, prefixes_BL), temperature=temperature, top_k=top_k, top_p=top_p
        )
        joint_BV = prob_B.unsqueeze(1) * p_BV
        rows, tokens = joint_BV.nonzero(as_tuple=True)
        prefixes_BL = torch.cat([prefixes_BL[rows], tokens.unsqueeze(1)], dim=1)
        prob_B = joint_BV[rows, tokens]
        order = prob_B.argsort(stable=True)
        drop = order[prob_B[order].cumsum(dim=0) <= budget]
        keep = torch.ones_like(prob_B, dtype=torch.bool).index_fill_(0, drop, False)
        dropped += float(prob_B[drop].sum())
        prefixes_BL, prob_B = prefixes_BL[keep], prob_B[keep]
    probs: dict[tuple[int, ...] | None, float] = dict(zip(map(tuple, prefixes_BL.tolist()), prob_B.tolist()))
    probs[None] = dropped
    return probs


def chi_square(
    counts: Mapping[Hashable, int], probs: Mapping[Hashable, float], n: int, *, min_expected: float = 5.0
) -> tuple[float, int]:
    """Pearson's chi-square statistic of `counts` (n draws in all) against `probs`, and its degrees
    of freedom (cells - 1).

    One pooled cell holds probs[None] (mass not enumerated), every counted key absent from `probs`,
    every category expected fewer than `min_expected` times (the usual validity rule of the
    chi-square approximation) and, while the pool itself expects fewer, the next smallest ones.
    A draw of a key absent from `probs` when probs[None] is 0 (a sequence of probability 0) makes
    the statistic infinite.
    """
    if sum(counts.values()) != n:
        raise ValueError(f"counts sum to {sum(counts.values())}, expected n = {n}")
    keys = [k for k in probs if k is not None]
    expected, order = torch.tensor([n * probs[k] for k in keys], dtype=torch.float64).sort()
    observed = torch.tensor([counts.get(k, 0) for k in keys], dtype=torch.float64)[order]
    rest_expected = n * probs.get(None, 0.0)
    rest_observed = sum(c for k, c in counts.items() if k not in probs)
    if rest_observed and not rest_expected:
        return math.inf, len(keys)
    # cell i joins the pool when it is small, or the pool before it still is
    pool_before = rest_expected + expected.cumsum(dim=0) - expected
    num_pooled = int(((expected < min_expected) | (pool_before < min_expected)).sum())
    pool_expected = rest_expected + float(expected[:num_pooled].sum())
    pool_observed = rest_observed + float(observed[:num_pooled].sum())
    expected, observed = expected[num_pooled:], observed[num_pooled:]
    if pool_expected > 0 or pool_observed > 0:
        expected = torch.cat([expected, torch.tensor([pool_expected], dtype=torch.float64)])
        observed = torch.cat([observed, torch.tensor([pool_observed], dtype=torch.float64)])
    return float(((observed - expected) ** 2 / expected).sum()), len(expected) - 1


def chi_square_threshold(dof: int, alpha: float = 1e-4) -> float:
    """The chi-square quantile at 1 - alpha for `dof` degrees of freedom by the Wilson-Hilferty
    approximation ((chi2 / dof)^(1/3) is nearly normal). At alpha = 1e-4 it lies above the exact
    quantile by < 2.3% from 5 dof up, < 0.6% from 20: a slightly smaller alpha, never a larger one."""
    z = NormalDist().inv_cdf(1 - alpha)
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@functools.cache
def tiny_reference(temperature: float, top_k: int | None = None) -> dict[tuple[int, ...] | None, float]:
    """`exact_prefix_distribution` of the tiny target's first three tokens after `reference_prompt()`,
    computed once per test session. mass = 1 - 1e-6: a few thousand draws expect ~0.004 draws of the
    mass left out (pooled by `chi_square`), and the enumeration keeps half the sequences of 1 - 1e-9."""
    return exact_prefix_distribution(load_target(), reference_prompt(), temperature=temperature, top_k=top_k,
                                     mass=1 - 1e-6)  # fmt: skip
