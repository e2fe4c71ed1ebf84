"""The standalone serving loop of one rank: prefill, then verify -> sync -> propose until every rank is done.

Built on the same `DraftRuntime` a serving engine embeds. Prompts are split over the DP ranks the
way a load-balancing scheduler would (uneven counts); a rank whose requests have all finished, or
that never had any, stays in as an idle participant (it still calls `propose` with no requests, so
it enters every MoE collective) until the agreed plan says no rank has rows left.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import msgspec
import torch

from epdraft.errors import RequestError
from epdraft.runtime import DraftRuntime
from epdraft.target.base import Target
from epdraft.target.hf import cache_kwarg
from epdraft.worker.timing import PhaseTimers

log = logging.getLogger(__name__)


class RequestOutcome(msgspec.Struct, kw_only=True):
    """One request's result, as gathered to rank 0."""

    request_id: int
    rank: int
    tokens: list[int] = []
    accept_lens: list[int] = []
    error: str | None = None
    reference_tokens: list[int] | None = None


class RankReport(msgspec.Struct, kw_only=True):
    """What one rank sends to rank 0 after the run."""

    rank: int
    steps: int
    loop_seconds: float
    phases: dict[str, float]
    requests: list[RequestOutcome]


def assign_prompts(prompt_lens: Sequence[int], max_new_tokens: int, num_ranks: int) -> list[list[int]]:
    """Prompt indices per rank: longest first onto the least-loaded rank (by tokens to process).

    Deterministic on every rank; counts come out uneven, as a real scheduler's do.
    """
    load = [0] * num_ranks
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in sorted(range(len(prompt_lens)), key=lambda i: (-prompt_lens[i], i)):
        r = min(range(num_ranks), key=lambda r: (load[r], r))
        ranks[r].append(i)
        load[r] += prompt_lens[i] + max_new_tokens
    return [sorted(r) for r in ranks]


@dataclasses.dataclass
class _Active:
    tokens: list[int]
    accept_lens: list[int]
    anchor: int


def serve_rank(
    runtime: DraftRuntime,
    target: Target,
    prompts: dict[int, list[int]],
    *,
    rank: int,
    max_new_tokens: int,
    timers: PhaseTimers,
    progress_every_s: float = 2.0,
) -> RankReport:
    """Generate `max_new_tokens` for each of this rank's prompts (request id -> token ids).

    A request the target refuses (empty prompt, id outside the vocabulary) is reported with its
    error; the others still run. Every rank must call this, an idle one with `prompts = {}`.
    """
    outcomes: dict[int, RequestOutcome] = {}
    active: dict[int, _Active] = {}
    for rid, prompt in prompts.items():
        try:
            with timers.phase("prefill"):
                pre = target.prefill([rid], [prompt])
        except RequestError as e:
            log.warning("%s", e)
            outcomes[rid] = RequestOutcome(request_id=rid, rank=rank, error=str(e))
            continue
        runtime.add_request(rid, pre.features)
        first = int(pre.first_tokens[0])
        active[rid] = _Active(tokens=[first], accept_lens=[], anchor=first)
        outcomes[rid] = RequestOutcome(request_id=rid, rank=rank)

    step, start, last_report = 0, time.perf_counter(), time.perf_counter()
    while True:
        running = [rid for rid, a in active.items() if len(a.tokens) < max_new_tokens]
        done_tokens = sum(len(a.tokens) for a in active.values())
        proposal = runtime.propose(step, {rid: active[rid].anchor for rid in running}, extras=(len(running), done_tokens))
        if proposal.plan.skip:
            break
        if running:
            blocks_NB = torch.stack(
                [torch.cat([torch.tensor([active[r].anchor]), proposal.drafts[r].cpu()]) for r in running]
            )
            with timers.phase("verify"):
                result = target.verify(running, blocks_NB)
            runtime.commit(result)
            for i, rid in enumerate(running):
                a = active[rid]
                a.tokens += result.emitted(i)
                a.accept_lens.append(int(result.accept_lens[i]))
                a.anchor = int(result.bonus[i])
                if len(a.tokens) >= max_new_tokens:
                    target.release(rid)
                    runtime.release(rid)
        now = time.perf_counter()
        if rank == 0 and now - last_report >= progress_every_s:
            extras = proposal.plan.extras
            log.info(
                "step %d: %d requests running on %d ranks, %d tokens so far, %.0f tok/s",
                step, sum(e[0] for e in extras), sum(1 for e in extras if e[0]),
                sum(e[1] for e in extras), sum(e[1] for e in extras) / (now - start),
            )
            last_report = now
        step += 1
    loop_seconds = time.perf_counter() - start
    for rid, a in active.items():
        outcomes[rid].tokens = a.tokens[:max_new_tokens]
        outcomes[rid].accept_lens = a.accept_lens
    return RankReport(
        rank=rank, steps=step, loop_seconds=loop_seconds, phases=timers.as_dict(), requests=list(outcomes.values())
    )


@torch.no_grad()
def greedy_reference(target_model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The target's own greedy decode, token by token with its KV cache and no draft.

    A plain loop rather than `generate`, whose EOS handling (`min_new_tokens` masks EOS logits)
    would change the argmax this must equal.
    """
    from transformers import DynamicCache

    device = target_model.get_input_embeddings().weight.device
    cache = DynamicCache(config=target_model.config)
    kw = cache_kwarg(target_model)
    ids = torch.tensor([prompt], device=device)
    tokens: list[int] = []
    while len(tokens) < max_new_tokens:
        logits = target_model(input_ids=ids, use_cache=True, **{kw: cache}).logits
        tokens.append(int(logits[0, -1].argmax()))
        ids = torch.tensor([[tokens[-1]]], device=device)
    return tokens
