"""Single-process speculative decoding (greedy or sampled): the reference loop the distributed runtime must equal."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from epdraft.config.sampling import SamplingParams
from epdraft.errors import ConfigError
from epdraft.models.dflash import DFlashDraft, check_finite
from epdraft.sampling import Readout, seeded
from epdraft.target.base import Target


@dataclasses.dataclass(frozen=True)
class SpeculativeOutput:
    """tokens: the generated ids (prompt excluded, exactly max_new_tokens of them).

    accept_lens: accepted drafts per verify step (0 .. B-1); tokens per step is that + 1.
    """

    tokens: list[int]
    accept_lens: list[int]

    @property
    def mean_accept_len(self) -> float:
        return sum(self.accept_lens) / max(len(self.accept_lens), 1)


def speculative_generate(
    target: Target,
    draft: DFlashDraft,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    request_id: int = 0,
    sampling: SamplingParams | None = None,
) -> SpeculativeOutput:
    """Speculative decode of one prompt. Greedy (`sampling` None or temperature 0) is lossless:
    tokens equal the target's own greedy decode; sampled, the tokens are distributed as the
    target's own sampling with `sampling` (and fixed by its seed, or by `request_id` without one).

    prefill -> draft context = prompt features, anchor = first token; then per step: the draft's
    step proposes its drafts, verify [anchor, drafts], append the committed rows' features to the
    draft context, emit accepted drafts + bonus, anchor = bonus. One request in a KV pool sized for
    the whole generation, the runtime's step without its sync.
    """
    if tuple(target.feature_layer_ids) != tuple(draft.spec.target_layer_ids):
        raise ConfigError(
            f"target features {list(target.feature_layer_ids)} != draft target_layer_ids {list(draft.spec.target_layer_ids)}"
        )
    params = seeded(sampling or SamplingParams(), 0, request_id)
    pre = target.prefill([request_id], [list(prompt_ids)], [params])
    pool = draft.new_pool(max_requests=1, max_context=len(prompt_ids) + max_new_tokens + draft.block_size)
    pool.admit(request_id, params)
    slots_N = torch.tensor([pool.slot(request_id)], device=draft.device)
    try:
        draft.extend(pool, [request_id], [pre.features])
        anchor = pre.first_tokens[:1]
        tokens, accept_lens = [int(anchor[0])], []
        while len(tokens) < max_new_tokens:
            step = draft.step(pool, slots_N, anchor.to(draft.device), target, None, readout=Readout.of([params]))
            check_finite(step.finite_L, "one request's block", pool.dtype)
            drafts = step.drafts_NK
            block = torch.cat([anchor.to(drafts.device).unsqueeze(1), drafts], dim=1)
            result = target.verify([request_id], block, step.probs_NKV)
            draft.extend(pool, [request_id], [result.features])
            tokens += result.emitted(0)
            accept_lens.append(int(result.accept_lens[0]))
            anchor = result.bonus[:1]
    finally:
        target.release(request_id)
    return SpeculativeOutput(tokens=tokens[:max_new_tokens], accept_lens=accept_lens)
