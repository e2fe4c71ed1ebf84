"""The draft step over per-request caches: the oracle the pooled step (`DFlashDraft.step`) is held against.

The same layers as the step, but each request's context comes from its own growing `DraftCache`,
padded into one batch with a key mask (`epdraft.models.cache`), and attention is SDPA over the
gathered keys, not the pool kernel. No part of the runtime calls it: tests compare the step with
it (every draft variant, sliding windows, idle ranks, the bf16 kernels), and it documents the
step's semantics in plain torch.

    caches = [new_cache(draft) for _ in requests]
    extend_caches(draft, caches, features)                 # each request's committed rows
    step = reference_step(draft, caches, anchors_N, heads)  # a DraftStep, like draft.step's
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from epdraft.dispatch import StepPlan
from epdraft.models.cache import ContextScratch, DraftCache, context_mask, padded_context
from epdraft.models.dflash import DFlashDraft, SampledReadout, TargetHeads, check_finite
from epdraft.models.step import DraftStep
from epdraft.sampling import SamplingBatch


def new_cache(draft: DFlashDraft) -> DraftCache:
    """An empty context for one request of `draft` (sliding layers keep their window only)."""
    spec = draft.spec
    return DraftCache(spec.num_layers, [spec.window(i) for i in range(spec.num_layers)])


@torch.no_grad()
def extend_caches(draft: DFlashDraft, caches: Sequence[DraftCache], features: Sequence[torch.Tensor]) -> None:
    """Append each request's committed rows' target features [L_i, K*H] to its cache (as `draft.extend`
    writes them into a pool: one fc and one K/V projection per layer over all the rows)."""
    # A sliding layer's cache keeps only the last W-1 of these rows (DraftCache.append).
    for layer, i, k_gLD, v_gLD in draft.context_rows([c.length for c in caches], features):
        caches[i].append(layer, k_gLD, v_gLD)
    for cache, f in zip(caches, features):
        cache.length += f.shape[0]


def reference_hidden(
    draft: DFlashDraft, caches: list[DraftCache], anchors_N: torch.Tensor, heads: TargetHeads,
    plan: StepPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(final-normed hidden [N, B, H] of the blocks [anchor, MASK x (B-1)] over each request's
    context, [num_layers] bool on the device: whether each layer's output stayed finite)."""
    B, device = draft.spec.block_size, draft.device
    ids_NB, x = draft.embed_blocks(anchors_N, heads)
    starts = torch.tensor([c.length for c in caches], dtype=torch.long, device=device)
    positions_NB = starts.unsqueeze(1) + torch.arange(B, device=device)
    # One mask and one scratch per attention kind (full, or the sliding window): their widths differ.
    masks: dict[int | None, torch.Tensor] = {}
    scratches: dict[int | None, ContextScratch] = {}
    finite_L = []
    for i, layer in enumerate(draft.layers):
        attn, w = layer.self_attn, layer.window
        if w not in masks:
            masks[w], scratches[w] = context_mask(caches, B, device, w), ContextScratch()
        k, v = padded_context(caches, i, x, attn.num_kv_heads, attn.head_dim, scratches[w])
        x = layer(x, positions_NB, k, v, masks[w], plan, ids_NB)
        finite_L.append(torch.isfinite(x).all())
    return draft.norm(x), torch.stack(finite_L)


@torch.no_grad()
def reference_step(
    draft: DFlashDraft, caches: list[DraftCache], anchors_N: torch.Tensor, heads: TargetHeads,
    plan: StepPlan | None = None, sampling: SamplingBatch | None = None,
) -> DraftStep:
    """What `draft.step` returns for these requests, computed over their caches; N may be 0 (every
    FFN still runs once, with `plan`); `sampling`: the requests' rows for a sampled step (as
    `draft.step(..., readout=...)` reads them from its pool). Raises NonFiniteError naming the
    first layer whose output went NaN or inf (one host read of the flags, after the readout)."""
    hidden, finite_L = reference_hidden(draft, caches, anchors_N, heads, plan)
    readout = None
    if sampling is not None:
        first_N = torch.tensor([c.length + 1 for c in caches], dtype=torch.long, device=hidden.device)
        readout = SampledReadout(sampling, first_N)
    drafts_NK, confidence_NK, probs_NKV = draft.read_out(draft.draft_rows(hidden), anchors_N, heads, readout)
    check_finite(finite_L, f"over {len(caches)} requests' blocks", hidden.dtype)
    return DraftStep(drafts_NK, finite_L, confidence_NK, probs_NKV)
