"""The standalone runner's serving loop, one for both placements: prefill, then propose -> verify
-> commit until every request has its tokens.

The loop runs on the ranks that hold the target. Where the drafts come from is the only thing a
placement changes, behind `Drafter`:

- colocated (`LocalDrafter`): this rank's own `DraftRuntime`. A rank whose requests have all
  finished, or that never had any, stays in as an idle participant (it still proposes with no
  requests, so it enters every MoE collective) until the agreed plan says no rank has rows left.
- disaggregated (`epdraft.worker.disagg.RemoteDrafter`): the paired draft rank, over the link.

Prompts are split over the ranks the way a load-balancing scheduler would (uneven counts).

Each request carries its SamplingParams (seed resolved by the job): the target prefills and
verifies with them, the drafter admits with them, and a step with a sampled request passes the
drafts' proposal probabilities to verify, which accepts each draft with probability
min(1, p/q) (DESIGN.md, Sampling).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from epdraft.config.sampling import SamplingParams
from epdraft.errors import RequestError
from epdraft.parallel.watchdog import Watchdog
from epdraft.runtime import DraftRuntime, PhaseTimers
from epdraft.target.base import Target, VerifyResult
from epdraft.target.hf import cache_kwarg
from epdraft.target.prompts import Prompt
from epdraft.worker.progress import Progress
from epdraft.worker.summary import RankReport, RequestOutcome

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Drafted:
    """One step's drafts (request id -> [B-1] int64), or `stop` when the loop must end.

    probs: request id -> [B-1, V] fp32, the proposal probabilities the drafts were sampled from;
    empty when every request of the step is greedy (and always from a RemoteDrafter, whose link
    carries none: a disaggregated run is greedy only).
    progress: (requests running, ranks with requests, tokens so far) over every rank, when the
    drafter knows them (the colocated step sync gathers them), for the progress line.
    """

    drafts: dict[int, torch.Tensor]
    probs: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    stop: bool = False
    progress: tuple[int, int, int] | None = None


class Drafter(Protocol):
    """Where the serving loop gets its drafts from; each method is called in the loop's order."""

    def admit(self, request_id: int, prompt_features: torch.Tensor, sampling: SamplingParams) -> None:
        """A prefilled request joins: its prompt rows' target features [L, K*H], and how it samples
        (the same params, seed included, the target prefilled it with)."""
        ...

    def propose(self, step: int, anchors: Mapping[int, int], tokens_so_far: int) -> Drafted:
        """Drafts for every running request (request id -> last verified token); anchors may be empty."""
        ...

    def commit(self, result: VerifyResult) -> None:
        """The step's verify result: committed rows go to the draft contexts."""
        ...

    def release(self, request_id: int) -> None:
        """A request finished."""
        ...


class LocalDrafter:
    """Colocated placement: this rank's DraftRuntime, whose step sync also gathers progress."""

    def __init__(self, runtime: DraftRuntime):
        self.runtime = runtime

    def admit(self, request_id: int, prompt_features: torch.Tensor, sampling: SamplingParams) -> None:
        self.runtime.add_request(request_id, prompt_features, sampling=sampling)

    def propose(self, step: int, anchors: Mapping[int, int], tokens_so_far: int) -> Drafted:
        proposal = self.runtime.propose(step, anchors, extras=(len(anchors), tokens_so_far))
        if proposal.plan.skip:
            return Drafted({}, stop=True)
        extras = proposal.plan.extras
        progress = (sum(e[0] for e in extras), sum(1 for e in extras if e[0]), sum(e[1] for e in extras))
        return Drafted(proposal.drafts, probs=proposal.probs, progress=progress)

    def commit(self, result: VerifyResult) -> None:
        self.runtime.commit(result)

    def release(self, request_id: int) -> None:
        self.runtime.release(request_id)


@dataclasses.dataclass
class _Active:
    """A running request. tests / expected_accepts: sums of the verify results' `tested` and
    `expected_accepts`, None once a step did not report them (unknown stays unknown)."""

    tokens: list[int]
    accept_lens: list[int]
    anchor: int
    tests: int | None = 0
    expected_accepts: float | None = 0.0


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


def serve_requests(
    target: Target,
    drafter: Drafter,
    prompts: dict[int, Prompt],
    *,
    rank: int,
    max_new_tokens: int,
    timers: PhaseTimers,
    watchdog: Watchdog | None = None,
    display: Progress | None = None,
    total_tokens: int | None = None,
    progress_every_s: float = 2.0,
) -> RankReport:
    """Generate `max_new_tokens` for each of this rank's prompts (request id -> its prompt, sampling
    seeded).

    A request the target refuses (empty prompt, id outside the vocabulary) is reported with its
    error; the others still run. Every target rank calls this, an idle one with `prompts = {}`.
    `watchdog`: told the step and phase (prefill, verify), so a peer that loses this rank names them.
    `display`: the terminal's progress line (prefill of this rank's prompts, then every rank's
    tokens out of `total_tokens`); when it draws, the periodic progress log is left out.
    The report's `loop_seconds` is the wall time of all of it, prefill included: the time the
    phase timers split.
    """
    note = watchdog.progress if watchdog is not None else lambda step=None, phase=None: None
    display = display if display is not None else Progress(None)
    wall_start = timers.now()
    note(phase="prefill")
    display.phase("prefill (this rank's prompts)", len(prompts), "prompts")
    outcomes: dict[int, RequestOutcome] = {}
    active: dict[int, _Active] = {}
    for n, (rid, prompt) in enumerate(prompts.items()):
        display.update(n)
        outcomes[rid] = RequestOutcome(request_id=rid, rank=rank, sampling=prompt.sampling)
        try:
            with timers.phase("prefill"):
                pre = target.prefill([rid], [prompt.ids], sampling=[prompt.sampling])
        except RequestError as e:
            log.warning("%s", e)
            outcomes[rid].error = str(e)
            continue
        drafter.admit(rid, pre.features, prompt.sampling)
        first = int(pre.first_tokens[0])
        active[rid] = _Active(tokens=[first], accept_lens=[], anchor=first)

    display.update(len(prompts))
    display.phase("decoding", total_tokens, "tokens")
    step, start, last_report = 0, time.perf_counter(), time.perf_counter()
    while True:
        running = [rid for rid, a in active.items() if len(a.tokens) < max_new_tokens]
        done_tokens = sum(len(a.tokens) for a in active.values())
        drafted = drafter.propose(step, {rid: active[rid].anchor for rid in running}, done_tokens)
        if drafted.stop:
            break
        if running:
            blocks_NB = torch.stack(
                [torch.cat([torch.tensor([active[r].anchor]), drafted.drafts[r].cpu()]) for r in running]
            )
            # Every running request has probabilities when any has (the step's batch samples).
            draft_probs_NKV = torch.stack([drafted.probs[r] for r in running]) if drafted.probs else None
            note(step, "verify")
            with timers.phase("verify"):
                result = target.verify(running, blocks_NB, draft_probs_NKV=draft_probs_NKV)
            drafter.commit(result)
            tested = result.tested.tolist() if result.tested is not None else None
            expected = result.expected_accepts.tolist() if result.expected_accepts is not None else None
            for i, rid in enumerate(running):
                a = active[rid]
                a.tokens += result.emitted(i)
                a.accept_lens.append(int(result.accept_lens[i]))
                a.anchor = int(result.bonus[i])
                a.tests = a.tests + tested[i] if a.tests is not None and tested is not None else None
                a.expected_accepts = (a.expected_accepts + expected[i]
                                      if a.expected_accepts is not None and expected is not None else None)  # fmt: skip
                if len(a.tokens) >= max_new_tokens:
                    target.release(rid)
                    drafter.release(rid)
        now = time.perf_counter()
        if drafted.progress is not None:
            display.update(drafted.progress[2])
        if rank == 0 and not display.enabled and drafted.progress is not None and now - last_report >= progress_every_s:
            requests, ranks, tokens = drafted.progress
            log.info(
                "step %d: %d requests running on %d ranks, %d tokens so far, %.0f tok/s",
                step, requests, ranks, tokens, tokens / (now - start),
            )  # fmt: skip
            last_report = now
        step += 1
    loop_seconds = timers.now() - wall_start
    for rid, a in active.items():
        outcomes[rid].tokens = a.tokens[:max_new_tokens]
        outcomes[rid].accept_lens = a.accept_lens
        outcomes[rid].tests, outcomes[rid].expected_accepts = a.tests, a.expected_accepts
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
