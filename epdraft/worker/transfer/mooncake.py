"""Step payloads over Mooncake's TransferEngine: one-sided writes into the peer's registered buffer.

Each rank runs one engine in P2PHANDSHAKE mode (no metadata server); Mooncake picks the wire
(RDMA where it finds HCAs, TCP otherwise). At `register()` every peer buffer is allocated and
registered once (a receive buffer where the rank receives, a staging buffer where it sends), and
the pair exchanges session ids, buffer addresses, specs and directions as msgspec
messages over a gloo (CPU) group. Per step and pair, on the same gloo group:

    receiver --Credit(seq)--> sender      "my buffer for you is free" (sent on entering recv)
    sender: copy rows into its registered staging buffer, transfer_sync_write into the peer's
    sender --StepPayloadMeta--> receiver  "the bytes are in place" (after the write returned)

so a sender never overwrites rows the receiver still reads, and nothing is registered per step.
"""

from __future__ import annotations

import logging
from typing import Mapping

import torch
import torch.distributed as dist

from epdraft.errors import ConfigError, ParallelError
from epdraft.worker.transfer.base import (
    BufferSpec,
    Direction,
    StepPayload,
    StepPayloadMeta,
    check_meta,
    check_pairing,
    check_payload,
    check_register,
    peer_spec,
)
from epdraft.worker.transfer.control import CREDIT_FRAME_BYTES, HELLO_FRAME_BYTES, ControlChannel, Credit, Hello

logger = logging.getLogger(__name__)

INSTALL_HINT = "transfer = 'mooncake' needs Mooncake: pip install 'epdraft[mooncake]'"
_CREDIT_TAG = 1
_DONE_TAG = 2


def unavailable_reason() -> str | None:
    """Why `transfer = 'mooncake'` cannot run here, or None when `mooncake.engine` imports."""
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as e:
        return import_failure_reason(e)
    return None


def import_failure_reason(error: ImportError) -> str:
    """The one line for a failed `import mooncake.engine`: the system library Mooncake links when
    that is what is missing (the wheel is there), else the install command."""
    if "libibverbs" in str(error):
        return ("transfer = 'mooncake' needs the system library libibverbs.so.1, which Mooncake's wheel links "
                f"(Debian: apt-get install -y libibverbs1) ({error})")
    hint = INSTALL_HINT
    if (torch.version.cuda or "").startswith("13."):
        hint += " (on this CUDA 13 host: pip install 'epdraft[mooncake-cuda13]')"
    return f"{hint} ({error})"


class MooncakeTransport:
    """`Transport` over a Mooncake TransferEngine; control messages on the gloo `group`.

    hostname: the address peers reach this rank at (the node's IP; 127.0.0.1 on one host).
    device_name: RDMA HCA allow-list such as "mlx5_0,mlx5_1"; "" lets Mooncake use all it finds.
    """

    name = "mooncake"

    def __init__(
        self, group: dist.ProcessGroup, *, hostname: str, device: torch.device | str = "cpu", device_name: str = ""
    ) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise ConfigError(reason)
        import mooncake.engine as mc

        self._device = torch.device(device)
        if self._device.type == "cuda" and not mc.SUPPORT_CUDA:
            raise ConfigError(
                "transfer = 'mooncake' on cuda tensors needs a CUDA build of Mooncake "
                "(mooncake-transfer-engine-cuda13 on CUDA 13 hosts); the installed one is CPU-only"
            )
        backend = str(dist.get_backend(group))
        if backend != "gloo":
            raise ConfigError(f"transfer = 'mooncake' sends its control messages over a gloo group, got {backend}")
        self._rank = dist.get_rank()
        self._members = set(dist.get_process_group_ranks(group))
        self._engine = mc.TransferEngine()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", "rdma", device_name)
        if rc != 0:
            raise ParallelError(f"rank {self._rank}: Mooncake TransferEngine.initialize({hostname!r}) returned {rc}")
        self.session_id = f"{hostname}:{self._engine.get_rpc_port()}"
        self._channel = ControlChannel(group, torch.device("cpu"), use_tags=True)
        self._register_called = False
        self._direction: Direction = "both"
        self._specs: dict[int, BufferSpec] = {}
        self._recv_RD: dict[int, torch.Tensor] = {}
        self._send_RD: dict[int, torch.Tensor] = {}
        self._peer_session: dict[int, str] = {}
        self._peer_addr: dict[int, int] = {}
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}
        self.registered: list[int] = []  # every address given to register_memory, in order

    def register(self, peers: Mapping[int, BufferSpec], direction: Direction = "both") -> None:
        """Allocate and register a receive buffer per peer this rank receives from and a staging
        buffer per peer it sends to; swap addresses, specs and directions."""
        if self._register_called:
            raise ParallelError(f"rank {self._rank}: mooncake transport register() called twice")
        self._register_called = True
        check_register(self._rank, self._members, peers, direction)
        hellos = {}
        for peer, spec in peers.items():
            if direction != "send":
                self._recv_RD[peer] = self._register(spec.empty_features(self._device))
            if direction != "recv":
                self._send_RD[peer] = self._register(spec.empty_features(self._device))
            recv_addr = self._recv_RD[peer].data_ptr() if peer in self._recv_RD else 0
            hellos[peer] = Hello(
                rank=self._rank, spec=spec, direction=direction, endpoint=self.session_id, recv_addr=recv_addr
            )
        replies = self._channel.exchange(hellos, Hello, HELLO_FRAME_BYTES)
        for peer, spec in peers.items():
            check_pairing(self._rank, peer, spec, direction, replies[peer].spec, replies[peer].direction)
            self._peer_session[peer] = replies[peer].endpoint
            self._peer_addr[peer] = replies[peer].recv_addr
            self._sent[peer] = self._received[peer] = 0
        self._specs = dict(peers)
        self._direction = direction
        logger.debug("rank %d: mooncake session %s, peers %s (%s)", self._rank, self.session_id, self._peer_session,
                     direction)  # fmt: skip

    def send(self, peer: int, payload: StepPayload) -> None:
        spec = self._spec(peer, "send")
        meta = check_payload(payload, spec, peer)
        credit = self._channel.recv(peer, Credit, CREDIT_FRAME_BYTES, _CREDIT_TAG)
        if credit.seq != self._sent[peer]:
            raise ParallelError(
                f"rank {self._rank}: rank {peer} freed its buffer for message {credit.seq}, "
                f"this rank is sending message {self._sent[peer]}"
            )
        nbytes = meta.num_rows * spec.feature_dim * spec.torch_dtype.itemsize
        if nbytes:
            staging_RD = self._send_RD[peer][: meta.num_rows]
            if payload.features_RD.data_ptr() != staging_RD.data_ptr() or not payload.features_RD.is_contiguous():
                staging_RD.copy_(payload.features_RD)
            if staging_RD.is_cuda:
                torch.cuda.current_stream(staging_RD.device).synchronize()
            session = self._peer_session[peer]
            rc = self._engine.transfer_sync_write(session, staging_RD.data_ptr(), self._peer_addr[peer], nbytes)
            if rc != 0:
                raise ParallelError(
                    f"rank {self._rank}: mooncake write of step {meta.step} ({nbytes} B) to rank {peer} "
                    f"(session {session}) returned {rc}"
                )
        self._channel.send(peer, meta, spec.meta_frame_bytes, _DONE_TAG)
        self._sent[peer] += 1

    def recv(self, peer: int) -> StepPayload:
        spec = self._spec(peer, "recv")
        self._channel.post(peer, Credit(seq=self._received[peer]), CREDIT_FRAME_BYTES, _CREDIT_TAG)
        meta = self._channel.recv(peer, StepPayloadMeta, spec.meta_frame_bytes, _DONE_TAG)
        check_meta(meta, spec, peer)
        self._received[peer] += 1
        return StepPayload(
            step=meta.step,
            features_RD=self._recv_RD[peer][: meta.num_rows],
            accept_lens=meta.accept_lens,
            bonus_tokens=meta.bonus_tokens,
        )

    def send_buffer(self, peer: int) -> torch.Tensor:
        self._spec(peer, "send")
        return self._send_RD[peer]

    def buffer_addresses(self) -> tuple[int, ...]:
        return tuple(self._recv_RD[p].data_ptr() for p in sorted(self._recv_RD)) + tuple(
            self._send_RD[p].data_ptr() for p in sorted(self._send_RD)
        )

    def close(self) -> None:
        """Finish control messages in flight, then unregister every buffer this transport registered."""
        self._channel.close()
        for addr in self.registered:
            rc = self._engine.unregister_memory(addr)
            if rc != 0:
                logger.warning("rank %d: mooncake unregister_memory(0x%x) returned %d", self._rank, addr, rc)
        self.registered.clear()
        self._recv_RD.clear()
        self._send_RD.clear()
        self._specs.clear()

    def _register(self, buf: torch.Tensor) -> torch.Tensor:
        nbytes = buf.numel() * buf.element_size()
        if nbytes:
            rc = self._engine.register_memory(buf.data_ptr(), nbytes)
            if rc != 0:
                raise ParallelError(
                    f"rank {self._rank}: mooncake register_memory of {nbytes} B at 0x{buf.data_ptr():x} returned {rc}"
                )
            self.registered.append(buf.data_ptr())
        return buf

    def _spec(self, peer: int, doing: Direction) -> BufferSpec:
        return peer_spec(self._rank, self._specs, self._direction, peer, doing)
