"""Small msgspec messages between paired ranks, framed in fixed-size uint8 tensors.

torch.distributed point-to-point needs the receiver to know the size in advance, so each message
kind has a fixed frame size both sides compute from the same `BufferSpec` (or a constant): 4 bytes
of little-endian length, then msgpack. Frames are allocated on first use per (peer, kind) and
reused; a frame is rewritten only after its previous send completed.
"""

from __future__ import annotations

import logging
from typing import Mapping, TypeVar

import msgspec
import torch
import torch.distributed as dist

from epdraft.errors import ParallelError
from epdraft.parallel.p2p import start, wait
from epdraft.worker.transfer.base import BufferSpec, Direction

HELLO_FRAME_BYTES = 1024
CREDIT_FRAME_BYTES = 32

M = TypeVar("M")

logger = logging.getLogger(__name__)


class Hello(msgspec.Struct, frozen=True, kw_only=True):
    """Sent once per peer pair at register(): who I am, the room I reserved, where to write."""

    rank: int
    spec: BufferSpec
    direction: Direction = "both"  # this rank's with the peer
    endpoint: str = ""
    recv_addr: int = 0  # 0 where this rank receives nothing from the peer


class Credit(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Receiver -> sender: my buffer for you is free, write message number `seq` into it."""

    seq: int


class ControlChannel:
    """Fixed-size message frames to and from peers on one process group.

    `device` is where frames live: CPU for gloo, the rank's CUDA device for NCCL. `tag`
    separates streams of different kinds between the same pair (gloo only; NCCL keeps order).
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, *, use_tags: bool) -> None:
        self._group = group
        self._device = device
        self._use_tags = use_tags
        self._encoder = msgspec.msgpack.Encoder()
        self._frames: dict[tuple[int, str, int], torch.Tensor] = {}
        self._pending: dict[tuple[int, int], dist.Work] = {}

    def _frame(self, peer: int, direction: str, tag: int, nbytes: int) -> torch.Tensor:
        key = (peer, direction, tag)
        frame = self._frames.get(key)
        if frame is None or frame.numel() != nbytes:
            frame = torch.zeros(nbytes, dtype=torch.uint8, device=self._device)
            self._frames[key] = frame
        return frame

    def post(self, peer: int, msg: msgspec.Struct, nbytes: int, tag: int = 0) -> None:
        """Start sending `msg` to `peer`; the frame is reused once the send completed."""
        self.flush(peer, tag)
        body = self._encoder.encode(msg)
        if len(body) + 4 > nbytes:
            raise ParallelError(f"{type(msg).__name__} for rank {peer} needs {len(body) + 4} B > frame of {nbytes} B")
        frame = self._frame(peer, "send", tag, nbytes)
        data = bytearray(len(body).to_bytes(4, "little") + body)
        frame[: len(data)].copy_(torch.frombuffer(data, dtype=torch.uint8))
        self._pending[(peer, tag)] = start(
            lambda: dist.isend(frame, dst=peer, group=self._group, **self._tag(tag)), f"control message to rank {peer}"
        )

    def flush(self, peer: int, tag: int = 0) -> None:
        """Wait until the last message posted to `peer` under `tag` has left."""
        work = self._pending.pop((peer, tag), None)
        if work is not None:
            wait(work, f"control message to rank {peer}")

    def send(self, peer: int, msg: msgspec.Struct, nbytes: int, tag: int = 0) -> None:
        self.post(peer, msg, nbytes, tag)
        self.flush(peer, tag)

    def recv(self, peer: int, kind: type[M], nbytes: int, tag: int = 0) -> M:
        """Block until the next `kind` message from `peer` under `tag` arrives."""
        frame = self._frame(peer, "recv", tag, nbytes)
        what = f"control message from rank {peer}"
        wait(start(lambda: dist.irecv(frame, src=peer, group=self._group, **self._tag(tag)), what), what)
        raw = frame.cpu().numpy().tobytes()
        size = int.from_bytes(raw[:4], "little")
        try:
            return msgspec.msgpack.decode(raw[4 : 4 + size], type=kind)
        except msgspec.DecodeError as e:
            raise ParallelError(f"malformed {kind.__name__} from rank {peer}: {e}") from e

    def exchange(self, msgs: Mapping[int, msgspec.Struct], kind: type[M], nbytes: int, tag: int = 0) -> dict[int, M]:
        """Send msgs[peer] to every peer and receive one `kind` from each; no ordering deadlock."""
        for peer, msg in msgs.items():
            self.post(peer, msg, nbytes, tag)
        replies = {peer: self.recv(peer, kind, nbytes, tag) for peer in msgs}
        for peer in msgs:
            self.flush(peer, tag)
        return replies

    def close(self) -> None:
        """Wait for messages still in flight, then drop the frames; a peer already gone is only logged."""
        for peer, tag in list(self._pending):
            try:
                self.flush(peer, tag)
            except ParallelError as e:
                logger.warning("closing the transfer control channel: %s", e)
        self._frames.clear()

    def _tag(self, tag: int) -> dict[str, int]:
        return {"tag": tag} if self._use_tags else {}
