"""Disaggregated placement's two sides: target ranks verify, draft ranks draft, apart.

A target rank runs the common serving loop (`epdraft.worker.serve`) with a `RemoteDrafter`: per
step it sends its paired draft rank the step's `TargetStep` + payload, waits for the drafts and
verifies them. It stops after sending `done` once none of its requests is running.

A draft rank serves every target rank paired with it. Every step, every draft rank calls
`DraftRuntime.propose` (an idle one with no requests), so the draft group's StepSync and MoE
collectives stay in lockstep among the draft ranks only; the loop ends when the agreed plan says
no draft rank has rows, which happens exactly when every target rank has sent `done`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from epdraft.config.sampling import SamplingParams
from epdraft.errors import ParallelError, RequestError
from epdraft.runtime import DraftRuntime, PhaseTimers
from epdraft.target.base import VerifyResult
from epdraft.worker.pairing import DraftStep, PeerLink, TargetStep
from epdraft.worker.serve import Drafted
from epdraft.worker.transfer import BufferSpec, StepPayload
from epdraft.worker.transfer.base import FEATURE_DTYPES

log = logging.getLogger(__name__)

def target_buffer_spec(prompt_lens: list[int], block_size: int, feature_dim: int, dtype: torch.dtype) -> BufferSpec:
    """Room for the largest step of a target rank: every prompt at once, or one block per request."""
    names = {v: k for k, v in FEATURE_DTYPES.items()}
    if dtype not in names:
        raise ParallelError(f"target features in {dtype} cannot be transferred; supported: {sorted(FEATURE_DTYPES)}")
    n = len(prompt_lens)
    return BufferSpec(
        max_rows=max(sum(prompt_lens), n * block_size), feature_dim=feature_dim, max_requests=n, dtype=names[dtype]
    )


class RemoteDrafter:
    """The target rank's `Drafter` under disaggregated placement: drafts come from `draft_rank`.

    Per step it sends the paired draft rank the step's TargetStep + payload (new requests' prompt
    features, the previous verify's committed rows, accept lengths and bonus tokens) and waits for
    the drafts. With no running request left it sends `done` and tells the loop to stop. The
    transport is registered at the first step, sized for every prompt admitted by then. Greedy
    requests only: its drafts come without proposal probabilities (`Drafted.probs` stays empty).
    """

    def __init__(
        self, link: PeerLink, draft_rank: int, feature_dim: int, feature_dtype: torch.dtype, timers: PhaseTimers
    ):
        self.link = link
        self.draft_rank = draft_rank
        self.feature_dim = feature_dim
        self.feature_dtype = feature_dtype
        self.timers = timers
        self._new: dict[int, torch.Tensor] = {}
        self._last: VerifyResult | None = None
        self._released: list[int] = []
        self._registered = False

    def admit(self, request_id: int, prompt_features: torch.Tensor, sampling: SamplingParams) -> None:
        assert sampling.greedy, "the disaggregated job refuses sampled prompts before serving (refuse_sampled)"
        self._new[request_id] = prompt_features

    def _register(self) -> None:
        lens = [len(f) for f in self._new.values()]
        spec = target_buffer_spec(lens, self.link.block_size, self.feature_dim, self.feature_dtype)
        self.link.register_as_target(self.draft_rank, spec)
        self._registered = True

    def propose(self, step: int, anchors: Mapping[int, int], tokens_so_far: int) -> Drafted:
        if not self._registered:
            self._register()
        link, draft_rank = self.link, self.draft_rank
        if not anchors:
            empty = link.transport.send_buffer(draft_rank)[:0]
            msg = TargetStep(step=step, request_ids=[], new_rows=[], released=self._released, done=True)
            link.send_target_step(draft_rank, msg, StepPayload(step=step, features_RD=empty, accept_lens=[], bonus_tokens=[]))
            return Drafted({}, stop=True)
        last = self._last
        committed = [i for i, rid in enumerate(last.request_ids) if rid in anchors] if last is not None else []
        ids = [last.request_ids[i] for i in committed] + list(self._new)
        buf_RD = link.transport.send_buffer(draft_rank)
        rows, new_rows, accept_lens = 0, [], []
        for i in committed:
            part = last.features[last.rows(i)]
            buf_RD[rows : rows + len(part)].copy_(part)
            rows += len(part)
            new_rows.append(0)
            accept_lens.append(int(last.accept_lens[i]))
        for part in self._new.values():
            buf_RD[rows : rows + len(part)].copy_(part)
            rows += len(part)
            new_rows.append(len(part))
            accept_lens.append(0)
        payload = StepPayload(
            step=step, features_RD=buf_RD[:rows], accept_lens=accept_lens, bonus_tokens=[anchors[r] for r in ids]
        )
        msg = TargetStep(step=step, request_ids=ids, new_rows=new_rows, released=self._released)
        with self.timers.phase("transfer"):
            link.send_target_step(draft_rank, msg, payload)
            drafts_NB = link.recv_draft_step(draft_rank, step, ids)
        self._new, self._released = {}, []
        return Drafted({rid: drafts_NB[i] for i, rid in enumerate(ids)})

    def commit(self, result: VerifyResult) -> None:
        self._last = result

    def release(self, request_id: int) -> None:
        self._released.append(request_id)


def serve_draft_rank(runtime: DraftRuntime, link: PeerLink, targets: tuple[int, ...], *, rank: int) -> int:
    """Draft for every request of the paired `targets` until no draft rank has rows; returns the step count."""
    live = list(targets)
    owner: dict[int, int] = {}  # request id -> target rank
    last_anchor: dict[int, int] = {}
    last_drafts: dict[int, torch.Tensor] = {}
    step = 0
    while True:
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
