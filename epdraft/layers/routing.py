"""Routing math as pure functions: scores, top-k selection, combine weights.

Everything here runs in fp32 whatever the model dtype: near-ties in bf16 logits flip the top-k
between ranks and implementations, and a flipped expert is a different output, not drift.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epdraft.config.ffn import RouterSpec


def score(logits_TE: torch.Tensor, scoring: str) -> torch.Tensor:
    """Scores [T, E] fp32 from router logits (for `softmax_topk`, the logits themselves)."""
    logits_TE = logits_TE.float()
    if scoring == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(logits_TE)
    if scoring == "sqrtsoftplus":
        return F.softplus(logits_TE).sqrt()
    if scoring == "softmax_topk":
        return logits_TE
    raise AssertionError(f"unvalidated scoring {scoring!r}")


def group_limited_mask(selection_TE: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """Keep the `topk_group` best groups (group score = sum of its top-2 scores); others -> -inf.

    -inf, not 0 (transformers v4): with sigmoid scores plus a negative bias a 0-filled expert of a
    dropped group can still outrank a kept one.
    """
    T, E = selection_TE.shape
    grouped_TGe = selection_TE.view(T, n_group, E // n_group)
    per_group = min(2, E // n_group)
    group_scores_TG = grouped_TGe.topk(per_group, dim=-1).values.sum(dim=-1)
    keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool)
    keep_TG.scatter_(1, group_scores_TG.topk(topk_group, dim=-1).indices, True)
    keep_TE = keep_TG.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    return selection_TE.masked_fill(~keep_TE, float("-inf"))


def route(
    logits_TE: torch.Tensor, spec: RouterSpec, selection_bias_E: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert ids and combine weights from router logits.

    Args:
        logits_TE: [T, E] router logits (any float dtype; a logit bias already added).
        spec: the router's spec.
        selection_bias_E: [E] fp32 noaux_tc bias: shifts the choice, never the weights.
    Returns:
        (topk_ids_TK int64, topk_weights_TK fp32); the weights are the final combine weights.
    """
    scores_TE = score(logits_TE, spec.scoring)
    if spec.scoring == "softmax_topk":
        values_TK, ids_TK = scores_TE.topk(spec.top_k, dim=-1)
        return ids_TK, torch.softmax(values_TK, dim=-1)
    selection_TE = scores_TE if selection_bias_E is None else scores_TE + selection_bias_E.float()
    if spec.group_limited:
        selection_TE = group_limited_mask(selection_TE, spec.n_group, spec.topk_group)
    ids_TK = selection_TE.topk(spec.top_k, dim=-1).indices
    weights_TK = scores_TE.gather(1, ids_TK)
    if spec.norm_topk_prob:
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + spec.renorm_eps)
    return ids_TK, weights_TK * spec.routed_scaling_factor


def hash_route(logits_TE: torch.Tensor, ids_TK: torch.Tensor, spec: RouterSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine weights of a hash-routed layer, whose experts are given (`tid2eid[token id]`).

    Args:
        logits_TE: [T, E] router logits (a logit bias already added).
        ids_TK: [T, K] int64 global expert ids of each token, from the token-id table.
        spec: the router's spec (`hash_routed`).
    Returns:
        (ids_TK, weights_TK fp32): the scores of the given experts, renormalized and scaled as `route` does.
    """
    weights_TK = score(logits_TE, spec.scoring).gather(1, ids_TK)
    if spec.norm_topk_prob:
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + spec.renorm_eps)
    return ids_TK, weights_TK * spec.routed_scaling_factor
