"""The transport contract: what a step payload is, how much room a peer pair reserves, and the protocol.

A transport moves one speculative step's payload (the target features of the committed rows, the
accept lengths, the bonus tokens and the step id) from one rank to a peer rank. Buffers are sized
once at `register()` from a `BufferSpec` and reused for every step, so the per-step cost is the wire
time plus a few small control messages, never an allocation or a memory registration.
"""

from __future__ import annotations

from typing import Literal, Mapping, Protocol, runtime_checkable

import msgspec
import torch

from epdraft.errors import ConfigError, ParallelError

FEATURE_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


# which way features flow between this rank and its peers: a target rank only sends its draft rank
# features, the draft rank only receives them (its drafts go back as control messages), so each side
# keeps the buffers of its own direction only
Direction = Literal["send", "recv", "both"]
_PAIRED = {"send": "recv", "recv": "send", "both": "both"}


class BufferSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Room reserved for one peer pair: the largest payload either side may send to the other.

    Both ranks of a pair must register the same spec; `register()` checks it.
    """

    max_rows: int
    feature_dim: int
    max_requests: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.max_rows < 0:
            raise ConfigError(f"transfer buffer: max_rows = {self.max_rows} must be >= 0")
        if self.feature_dim < 1:
            raise ConfigError(f"transfer buffer: feature_dim = {self.feature_dim} must be >= 1")
        if self.max_requests < 0:
            raise ConfigError(f"transfer buffer: max_requests = {self.max_requests} must be >= 0")
        if self.dtype not in FEATURE_DTYPES:
            raise ConfigError(f"transfer buffer: dtype = {self.dtype!r} must be one of {sorted(FEATURE_DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return FEATURE_DTYPES[self.dtype]

    @property
    def max_feature_bytes(self) -> int:
        return self.max_rows * self.feature_dim * self.torch_dtype.itemsize

    @property
    def meta_frame_bytes(self) -> int:
        """Bytes of the fixed-size frame that carries a `StepPayloadMeta` for this spec.

        msgpack stores an int in at most 9 bytes; two lists of `max_requests` ints, five scalar
        fields, the dtype name and the headers fit in this bound.
        """
        return 8 * ((4 + 96 + 18 * self.max_requests + 7) // 8)

    def empty_features(self, device: torch.device) -> torch.Tensor:
        """The preallocated [max_rows, feature_dim] buffer a transport keeps for this peer."""
        return torch.empty((self.max_rows, self.feature_dim), dtype=self.torch_dtype, device=device)


class StepPayloadMeta(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Everything of a step payload but the feature bytes: the control message that precedes them."""

    step: int
    num_rows: int
    feature_dim: int
    dtype: str
    accept_lens: list[int]
    bonus_tokens: list[int]


class StepPayload(msgspec.Struct, frozen=True, kw_only=True):
    """One step's data for one peer.

    features_RD: [rows, feature_dim] target features of the committed rows (rows may be 0).
    accept_lens, bonus_tokens: one entry per request of the sending rank.
    A received payload's `features_RD` is a view into the transport's buffer for that peer, valid
    until the next `recv` from the same peer.
    """

    step: int
    features_RD: torch.Tensor
    accept_lens: list[int]
    bonus_tokens: list[int]


def check_register(rank: int, members: set[int], peers: Mapping[int, BufferSpec], direction: str) -> None:
    """ConfigError for a `register` call no transport can take, before any buffer: a direction that
    is not one of `Direction`, a peer that is this rank or outside the group."""
    if direction not in _PAIRED:
        raise ConfigError(f"rank {rank}: transfer direction {direction!r} must be one of {sorted(_PAIRED)}")
    for peer in peers:
        if peer == rank or peer not in members:
            raise ConfigError(f"rank {rank}: transfer peer {peer} must be another rank of the group")


def check_pairing(
    rank: int, peer: int, spec: BufferSpec, direction: Direction, their_spec: BufferSpec, their_direction: str
) -> None:
    """Refuse a pair whose two `register()` calls disagree on the room or on who sends."""
    if their_spec != spec:
        raise ParallelError(f"rank {rank} registered {spec} for rank {peer}, which registered {their_spec}")
    if their_direction != _PAIRED[direction]:
        raise ParallelError(
            f"rank {rank} registered direction {direction!r} with rank {peer}, which registered "
            f"{their_direction!r} (one side sends and the other receives, or both do both)"
        )


def peer_spec(
    rank: int, specs: Mapping[int, BufferSpec], direction: Direction, peer: int, doing: Direction
) -> BufferSpec:
    """The spec registered for `peer`, after ParallelError when `peer` is not registered or this
    rank registered no buffers for `doing` ("send" / "recv") with it."""
    spec = specs.get(peer)
    if spec is None:
        raise ParallelError(f"rank {rank}: rank {peer} is not a registered transfer peer")
    if direction not in (doing, "both"):
        verb = {"send": "send", "recv": "receive"}
        raise ParallelError(
            f"rank {rank} registered to {verb[direction]} features with rank {peer} only; it cannot "
            f"{verb[doing]} them"
        )
    return spec


def check_payload(payload: StepPayload, spec: BufferSpec, peer: int) -> StepPayloadMeta:
    """The metadata of `payload`, after checking it fits what `register()` reserved for `peer`."""
    x = payload.features_RD
    if x.dim() != 2 or x.shape[1] != spec.feature_dim or x.dtype != spec.torch_dtype:
        raise ParallelError(
            f"step {payload.step} payload for rank {peer}: features_RD {tuple(x.shape)} {x.dtype} does not match "
            f"the registered [rows <= {spec.max_rows}, {spec.feature_dim}] {spec.dtype}"
        )
    if x.shape[0] > spec.max_rows:
        raise ParallelError(
            f"step {payload.step} payload for rank {peer}: {x.shape[0]} rows exceed max_rows = {spec.max_rows}"
        )
    if len(payload.accept_lens) != len(payload.bonus_tokens) or len(payload.accept_lens) > spec.max_requests:
        raise ParallelError(
            f"step {payload.step} payload for rank {peer}: {len(payload.accept_lens)} accept_lens and "
            f"{len(payload.bonus_tokens)} bonus_tokens must be equal in number and <= "
            f"max_requests = {spec.max_requests}"
        )
    return StepPayloadMeta(
        step=payload.step,
        num_rows=x.shape[0],
        feature_dim=spec.feature_dim,
        dtype=spec.dtype,
        accept_lens=list(payload.accept_lens),
        bonus_tokens=list(payload.bonus_tokens),
    )


def check_meta(meta: StepPayloadMeta, spec: BufferSpec, peer: int) -> None:
    """Refuse metadata from `peer` that would not fit the buffer reserved for it."""
    if meta.feature_dim != spec.feature_dim or meta.dtype != spec.dtype or not 0 <= meta.num_rows <= spec.max_rows:
        raise ParallelError(
            f"step {meta.step} from rank {peer}: [{meta.num_rows}, {meta.feature_dim}] {meta.dtype} does not fit "
            f"the registered [rows <= {spec.max_rows}, {spec.feature_dim}] {spec.dtype}"
        )


@runtime_checkable
class Transport(Protocol):
    """Moves step payloads between paired ranks.

    `register` once (every rank named in `peers` must call it with this rank among its peers, the
    same spec and the paired direction), then any number of `send`/`recv` (in the registered
    direction), then `close`. `send` returns once the peer
    may read the bytes or they are safely in flight, and may wait until the peer enters `recv`
    (its buffer is free again). `recv` returns only after the sender's completion message says
    the bytes are in place. Failures (peer gone, timeout, a write refused) raise ParallelError
    naming the peer.
    """

    name: str

    def register(self, peers: Mapping[int, BufferSpec], direction: Direction = "both") -> None:
        """Allocate (and, for RDMA-capable backends, register) the buffers of `direction` per peer
        (a receive buffer where this rank receives, a send buffer where it sends); once per
        transport. Every peer must register the paired direction ("send" with "recv")."""
        ...

    def send(self, peer: int, payload: StepPayload) -> None:
        """Deliver one step's payload to `peer`'s buffer, then signal completion."""
        ...

    def recv(self, peer: int) -> StepPayload:
        """The next payload from `peer`; its rows are a view of this rank's buffer, valid until the next recv."""
        ...

    def send_buffer(self, peer: int) -> torch.Tensor:
        """A preallocated [max_rows, feature_dim] tensor for `peer`: fill its leading rows and pass
        them as `features_RD` to send without a staging copy. Reused: refill it only after `send`
        returned."""
        ...

    def buffer_addresses(self) -> tuple[int, ...]:
        """Addresses of the buffers allocated at `register()`; constant until `close()`."""
        ...

    def close(self) -> None:
        """Release the buffers and the engine; the transport cannot be used afterwards."""
        ...
