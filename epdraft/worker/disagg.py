"""The serving loops of disaggregated placement: target ranks verify, draft ranks draft, apart.

A target rank prefills its requests, then per step sends its paired draft rank the step's
`TargetStep` + payload (new requests' prompt features, the previous verify's committed rows,
accept lengths and bonus tokens), waits for the drafts and verifies them. It stops after sending
`done` once none of its requests is running.

A draft rank serves every target rank paired with it. Every step, every draft rank calls
`DraftRuntime.propose` (an idle one with no requests), so the draft group's StepSync and MoE
collectives stay in lockstep among the draft ranks only; the loop ends when the agreed plan says
no draft rank has rows, which happens exactly when every target rank has sent `done`.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import torch

from epdraft.errors import ParallelError, RequestError
from epdraft.runtime import DraftRuntime
from epdraft.target.base import Target, VerifyResult
from epdraft.worker.generate import RankReport, RequestOutcome
from epdraft.worker.pairing import DraftStep, PeerLink, TargetStep
from epdraft.worker.timing import PhaseTimers
from epdraft.worker.transfer import BufferSpec, StepPayload
from epdraft.worker.transfer.base import FEATURE_DTYPES

log = logging.getLogger(__name__)

# Fault injection for the failure test: "RANK:STEP" makes global rank RANK SIGKILL itself as its
# draft loop enters step STEP, the way a crashed node disappears. Unset (the default): no effect.
KILL_AT_STEP_ENV = "EPDRAFT_TEST_KILL_DRAFT_AT"


def target_buffer_spec(prompt_lens: list[int], block_size: int, feature_dim: int, dtype: torch.dtype) -> BufferSpec:
    """Room for the largest step of a target rank: every prompt at once, or one block per request."""
    names = {v: k for k, v in FEATURE_DTYPES.items()}
    if dtype not in names:
        raise ParallelError(f"target features in {dtype} cannot be transferred; supported: {sorted(FEATURE_DTYPES)}")
    n = len(prompt_lens)
    return BufferSpec(
        max_rows=max(sum(prompt_lens), n * block_size), feature_dim=feature_dim, max_requests=n, dtype=names[dtype]
    )


def serve_target_rank(
    target: Target,
    link: PeerLink,
    draft_rank: int,
    prefilled: dict[int, tuple[int, torch.Tensor]],
    outcomes: dict[int, RequestOutcome],
    *,
    rank: int,
    max_new_tokens: int,
    timers: PhaseTimers,
) -> RankReport:
    """Generate `max_new_tokens` per request; `prefilled[rid] = (first token, prompt features [L, K*H])`.

    `outcomes` holds every request of this rank (refused ones carry their error already).
    """
    tokens = {rid: [first] for rid, (first, _) in prefilled.items()}
    accepts: dict[int, list[int]] = {rid: [] for rid in prefilled}
    anchor = {rid: first for rid, (first, _) in prefilled.items()}
    new = list(prefilled)
    last: VerifyResult | None = None
    released: list[int] = []
    step, start = 0, time.perf_counter()
    while True:
        running = [rid for rid in tokens if len(tokens[rid]) < max_new_tokens]
        if not running:
            empty = link.transport.send_buffer(draft_rank)[:0]
            msg = TargetStep(step=step, request_ids=[], new_rows=[], released=released, done=True)
            payload = StepPayload(step=step, features_RD=empty, accept_lens=[], bonus_tokens=[])
            link.send_target_step(draft_rank, msg, payload)
            break
        committed = [i for i, rid in enumerate(last.request_ids) if rid in running] if last is not None else []
        ids = [last.request_ids[i] for i in committed] + new
        buf_RD = link.transport.send_buffer(draft_rank)
        rows, new_rows, accept_lens = 0, [], []
        for i in committed:
            part = last.features[last.rows(i)]
            buf_RD[rows : rows + len(part)].copy_(part)
            rows += len(part)
            new_rows.append(0)
            accept_lens.append(int(last.accept_lens[i]))
        for rid in new:
            part = prefilled[rid][1]
            buf_RD[rows : rows + len(part)].copy_(part)
            rows += len(part)
            new_rows.append(len(part))
            accept_lens.append(0)
        payload = StepPayload(
            step=step, features_RD=buf_RD[:rows], accept_lens=accept_lens, bonus_tokens=[anchor[r] for r in ids]
        )
        msg = TargetStep(step=step, request_ids=ids, new_rows=new_rows, released=released)
        with timers.phase("transfer"):
            link.send_target_step(draft_rank, msg, payload)
            drafts_NB = link.recv_draft_step(draft_rank, step, ids)
        blocks_NB = torch.cat([torch.tensor([[anchor[r]] for r in ids]), drafts_NB], dim=1)
        with timers.phase("verify"):
            last = target.verify(ids, blocks_NB)
        new, released = [], []
        for i, rid in enumerate(ids):
            tokens[rid] += last.emitted(i)
            accepts[rid].append(int(last.accept_lens[i]))
            anchor[rid] = int(last.bonus[i])
            if len(tokens[rid]) >= max_new_tokens:
                target.release(rid)
                released.append(rid)
        step += 1
    loop_seconds = time.perf_counter() - start
    for rid in prefilled:
        outcomes[rid].tokens = tokens[rid][:max_new_tokens]
        outcomes[rid].accept_lens = accepts[rid]
    return RankReport(
        rank=rank, steps=step, loop_seconds=loop_seconds, phases=timers.as_dict(), requests=list(outcomes.values())
    )


def serve_draft_rank(runtime: DraftRuntime, link: PeerLink, targets: tuple[int, ...], *, rank: int) -> int:
    """Draft for every request of the paired `targets` until no draft rank has rows; returns the step count."""
    kill_at = _kill_step(rank)
    live = list(targets)
    owner: dict[int, int] = {}  # request id -> target rank
    last_anchor: dict[int, int] = {}
    last_drafts: dict[int, torch.Tensor] = {}
    step = 0
    while True:
        if step == kill_at:
            log.warning("%s: killing this rank at step %d", KILL_AT_STEP_ENV, step)
            os.kill(os.getpid(), signal.SIGKILL)
        anchors: dict[int, int] = {}
        asked: dict[int, list[int]] = {}
        for t in list(live):
            msg, payload = link.recv_target_step(t, step)
            for rid in msg.released:
                runtime.release(rid)
                owner.pop(rid, None)
            if msg.done:
                live.remove(t)
                continue
            _apply(runtime, t, msg, payload, owner, last_anchor, last_drafts)
            asked[t] = msg.request_ids
            anchors.update({rid: tok for rid, tok in zip(msg.request_ids, payload.bonus_tokens)})
        try:
            proposal = runtime.propose(step, anchors)
        except RuntimeError as e:
            raise ParallelError(
                f"draft rank {rank}: the draft group's step {step} failed (a draft rank stopped answering?): {e}"
            ) from e
        if proposal.plan.skip:
            if live:
                raise ParallelError(
                    f"draft rank {rank}: step {step} agreed to stop while target ranks {live} still run"
                )
            return step
        for t, ids in asked.items():
            for rid in ids:
                last_anchor[rid], last_drafts[rid] = anchors[rid], proposal.drafts[rid].cpu()
            drafts = [last_drafts[r].tolist() for r in ids]
            link.send_draft_step(t, DraftStep(step=step, request_ids=ids, drafts=drafts))
        step += 1


def _apply(
    runtime: DraftRuntime,
    target: int,
    msg: TargetStep,
    payload: StepPayload,
    owner: dict[int, int],
    last_anchor: dict[int, int],
    last_drafts: dict[int, torch.Tensor],
) -> None:
    """Add the step's new requests and commit its verified rows to the draft contexts."""
    rows, commit = 0, []
    for i, rid in enumerate(msg.request_ids):
        n = msg.new_rows[i] or payload.accept_lens[i] + 1
        features = payload.features_RD[rows : rows + n]
        rows += n
        if msg.new_rows[i]:
            if rid in owner:
                raise RequestError(
                    f"request {rid} of target rank {target} is already served for target rank {owner[rid]}"
                )
            runtime.add_request(rid, features)
            owner[rid] = target
        else:
            commit.append((i, rid, features))
    if rows != payload.features_RD.shape[0]:
        raise ParallelError(
            f"step {msg.step} from target rank {target}: entries need {rows} rows, the payload has "
            f"{payload.features_RD.shape[0]}"
        )
    if not commit:
        return
    # The committed rows are the anchor the draft saw plus the drafts the target accepted, so the
    # draft rebuilds the VerifyResult from its own proposals: only lengths and bonus tokens travel.
    accept_N = torch.tensor([payload.accept_lens[i] for i, _, _ in commit], dtype=torch.int64)
    committed = [
        torch.cat([torch.tensor([last_anchor[rid]]), last_drafts[rid][: int(a)]])
        for (_, rid, _), a in zip(commit, accept_N)
    ]
    runtime.commit(
        VerifyResult(
            request_ids=tuple(rid for _, rid, _ in commit),
            accept_lens=accept_N,
            bonus=torch.tensor([payload.bonus_tokens[i] for i, _, _ in commit], dtype=torch.int64),
            commit_lens=accept_N + 1,
            committed_ids=torch.cat(committed),
            features=torch.cat([f for _, _, f in commit]),
        )
    )


def _kill_step(rank: int) -> int | None:
    """The step at which `KILL_AT_STEP_ENV` asks this rank to die, or None."""
    value = os.environ.get(KILL_AT_STEP_ENV, "")
    if not value:
        return None
    who, _, at = value.partition(":")
    if not (who.isdigit() and at.isdigit()):
        raise ParallelError(f"{KILL_AT_STEP_ENV} = {value!r}: expected RANK:STEP, e.g. 3:5")
    return int(at) if int(who) == rank else None
