"""Disaggregated placement: which draft rank serves which target rank, and the link between the two.

Pairing: target DP rank i (its index in `ParallelConfig.target_ranks`) is served by draft DP rank
`i % n_draft` (its index in `draft_ranks`). When there are more target ranks than draft ranks, one
draft rank serves several target ranks and batches their requests into one MoE step; when there
are fewer, the unpaired draft ranks take part in every step as idle participants.

Per step `s` a pair exchanges, in this order:

    target --TargetStep(s)--> draft     request ids, which are new (prompt rows) and which ended
    target --StepPayload(s)-> draft     over the transport: committed rows' features, accept lens,
                                        bonus tokens (the next anchors)
    draft  --DraftStep(s)---> target    the drafted tokens of every request in TargetStep(s)

`PeerLink` checks the step id of everything it receives (`StepMismatch` naming both ranks) and
turns a peer that died or went silent past `cluster.timeout_s` (the process group's timeout, which
bounds every send and receive) into a `ParallelError` saying which rank stopped answering at which step.
"""

from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist

from epdraft.config.parallel import ParallelConfig
from epdraft.errors import ParallelError, StepMismatch
from epdraft.worker.transfer import BufferSpec, StepPayload, Transport
from epdraft.worker.transfer.control import HELLO_FRAME_BYTES, ControlChannel, Hello

# gloo tags of the link's own messages; the transports use tags 0..2 on the same group.
_SPEC_TAG = 16
_TARGET_STEP_TAG = 17
_DRAFT_STEP_TAG = 18


def paired_draft_rank(pc: ParallelConfig, target_rank: int) -> int:
    """The global rank of the draft rank serving `target_rank` (target DP i -> draft DP i % n_draft)."""
    if target_rank not in pc.target_ranks:
        raise ParallelError(f"rank {target_rank} is not a target rank (target ranks: {list(pc.target_ranks)})")
    i = pc.target_ranks.index(target_rank)
    return pc.draft_ranks[i % pc.draft_world_size]


def paired_target_ranks(pc: ParallelConfig, draft_rank: int) -> tuple[int, ...]:
    """The global ranks of the target ranks `draft_rank` serves, ascending (may be empty)."""
    if draft_rank not in pc.draft_ranks:
        raise ParallelError(f"rank {draft_rank} is not a draft rank (draft ranks: {list(pc.draft_ranks)})")
    return tuple(t for t in pc.target_ranks if paired_draft_rank(pc, t) == draft_rank)


class TargetStep(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Target -> draft, one per step, before the payload.

    request_ids: the requests to draft for this step, in payload order; entry i owns
        `new_rows[i]` prompt rows when it is new this step (its bonus token is the first anchor),
        else `accept_lens[i] + 1` committed rows of the previous verify.
    released: requests that finished at the previous verify (the draft drops their context).
    done: the target rank has no request left; it sends nothing more and expects no reply.
    """

    step: int
    request_ids: list[int]
    new_rows: list[int]
    released: list[int]
    done: bool = False


class DraftStep(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Draft -> target, one per step: drafts[i] are the B-1 draft tokens of request_ids[i]."""

    step: int
    request_ids: list[int]
    drafts: list[list[int]]


def target_step_frame_bytes(spec: BufferSpec) -> int:
    """A fixed frame bound for TargetStep: msgpack ints take <= 9 bytes, three lists of max_requests."""
    return 8 * ((64 + 27 * spec.max_requests + 7) // 8)


def draft_step_frame_bytes(spec: BufferSpec, block_size: int) -> int:
    """A fixed frame bound for DraftStep: per request an id and a list of B-1 ints."""
    return 8 * ((64 + spec.max_requests * (9 * block_size + 10) + 7) // 8)


class PeerLink:
    """This rank's side of its pairs: control messages on `channel`, payloads on `transport`.

    role: "target" or "draft" (this rank's role, for the messages). block_size: the draft's B.
    """

    def __init__(self, channel: ControlChannel, transport: Transport, *, role: str, block_size: int) -> None:
        self.channel = channel
        self.transport = transport
        self.role = role
        self.peer_role = "draft" if role == "target" else "target"
        self.block_size = block_size
        self.rank = dist.get_rank()
        self.specs: dict[int, BufferSpec] = {}

    def _failed(self, peer: int, step: int | None, e: Exception) -> ParallelError:
        when = f"at step {step}" if step is not None else "while pairing"
        return ParallelError(
            f"{self.peer_role} rank {peer} stopped answering {when} ({self.role} rank {self.rank}): {e}"
        )

    def register_as_target(self, draft: int, spec: BufferSpec) -> None:
        """Tell the paired draft rank how much room this target needs, then register the transport."""
        try:
            self.channel.send(draft, Hello(rank=self.rank, spec=spec), HELLO_FRAME_BYTES, _SPEC_TAG)
            self.transport.register({draft: spec}, "send")
        except (ParallelError, RuntimeError) as e:
            raise self._failed(draft, None, e) from e
        self.specs[draft] = spec

    def register_as_draft(self, targets: tuple[int, ...]) -> None:
        """Learn each paired target's room, then register the transport with all of them at once."""
        for t in targets:
            try:
                hello = self.channel.recv(t, Hello, HELLO_FRAME_BYTES, _SPEC_TAG)
            except (ParallelError, RuntimeError) as e:
                raise self._failed(t, None, e) from e
            self.specs[t] = hello.spec
        try:
            self.transport.register(dict(self.specs), "recv")
        except (ParallelError, RuntimeError) as e:
            raise ParallelError(f"draft rank {self.rank}: registering the transfer with {list(targets)}: {e}") from e

    def send_target_step(self, draft: int, msg: TargetStep, payload: StepPayload) -> None:
        spec = self.specs[draft]
        try:
            self.channel.send(draft, msg, target_step_frame_bytes(spec), _TARGET_STEP_TAG)
            self.transport.send(draft, payload)
        except (ParallelError, RuntimeError) as e:
            raise self._failed(draft, msg.step, e) from e

    def recv_target_step(self, target: int, step: int) -> tuple[TargetStep, StepPayload]:
        """The step's message and payload from `target`; StepMismatch if either is for another step."""
        spec = self.specs[target]
        try:
            msg = self.channel.recv(target, TargetStep, target_step_frame_bytes(spec), _TARGET_STEP_TAG)
            payload = self.transport.recv(target)
        except (ParallelError, RuntimeError) as e:
            raise self._failed(target, step, e) from e
        for what, got in (("step message", msg.step), ("payload", payload.step)):
            if got != step:
                raise StepMismatch(
                    f"draft rank {self.rank} at step {step} got the {what} of step {got} from target rank {target}"
                )
        if len(payload.accept_lens) != len(msg.request_ids) or len(msg.new_rows) != len(msg.request_ids):
            raise ParallelError(
                f"step {step} from target rank {target}: {len(msg.request_ids)} request ids, {len(msg.new_rows)} "
                f"new_rows and {len(payload.accept_lens)} accept lens must be equal in number"
            )
        return msg, payload

    def send_draft_step(self, target: int, msg: DraftStep) -> None:
        try:
            self.channel.send(target, msg, draft_step_frame_bytes(self.specs[target], self.block_size), _DRAFT_STEP_TAG)
        except (ParallelError, RuntimeError) as e:
            raise self._failed(target, msg.step, e) from e

    def recv_draft_step(self, draft: int, step: int, request_ids: list[int]) -> torch.Tensor:
        """The drafts [N, B-1] int64 for `request_ids` (in that order) at `step` from `draft`."""
        frame = draft_step_frame_bytes(self.specs[draft], self.block_size)
        try:
            msg = self.channel.recv(draft, DraftStep, frame, _DRAFT_STEP_TAG)
        except (ParallelError, RuntimeError) as e:
            raise self._failed(draft, step, e) from e
        if msg.step != step:
            raise StepMismatch(
                f"target rank {self.rank} at step {step} got the drafts of step {msg.step} from draft rank {draft}"
            )
        if msg.request_ids != request_ids or any(len(d) != self.block_size - 1 for d in msg.drafts):
            raise ParallelError(
                f"step {step}: draft rank {draft} drafted for requests {msg.request_ids}, target rank {self.rank} "
                f"asked for {request_ids} with {self.block_size - 1} tokens each"
            )
        return torch.tensor(msg.drafts, dtype=torch.int64).view(len(request_ids), self.block_size - 1)

    def close(self) -> None:
        self.transport.close()
        self.channel.close()
