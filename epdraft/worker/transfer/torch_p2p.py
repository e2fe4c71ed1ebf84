"""Step payloads over torch.distributed point-to-point (gloo on CPU, NCCL on GPU).

Per step and peer: one fixed-size metadata frame, then the feature rows (skipped for 0 rows). The
receiver posts its receive into the leading rows of the buffer preallocated at `register()`, so
the bytes land in place with no per-step allocation. Two-sided sends need no credit messages: the
data moves only once the receiver has posted its receive.
"""

from __future__ import annotations

import logging
from typing import Mapping

import torch
import torch.distributed as dist

from epdraft.errors import ConfigError, ParallelError
from epdraft.parallel.p2p import start, wait
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
from epdraft.worker.transfer.control import HELLO_FRAME_BYTES, ControlChannel, Hello

logger = logging.getLogger(__name__)

_DEVICE_OF_BACKEND = {"gloo": "cpu", "nccl": "cuda"}


class TorchP2PTransport:
    """`Transport` over isend/irecv on `group`; peers are global ranks that belong to `group`."""

    name = "torch"

    def __init__(self, group: dist.ProcessGroup, *, device: torch.device | str = "cpu") -> None:
        self._device = torch.device(device)
        backend = str(dist.get_backend(group))
        if _DEVICE_OF_BACKEND.get(backend) != self._device.type:
            raise ConfigError(
                f"transfer = 'torch': a {backend} group moves {_DEVICE_OF_BACKEND.get(backend, 'no')} tensors, "
                f"not {self._device} (gloo needs cpu, nccl needs cuda)"
            )
        self._group = group
        self._rank = dist.get_rank()
        self._members = set(dist.get_process_group_ranks(group))
        self._channel = ControlChannel(group, self._device, use_tags=backend == "gloo")
        self._register_called = False
        self._direction: Direction = "both"
        self._specs: dict[int, BufferSpec] = {}
        self._recv_RD: dict[int, torch.Tensor] = {}
        self._send_RD: dict[int, torch.Tensor] = {}

    def register(self, peers: Mapping[int, BufferSpec], direction: Direction = "both") -> None:
        """Check every peer agrees on its spec and direction, then allocate one receive buffer per
        peer this rank receives from."""
        if self._register_called:
            raise ParallelError(f"rank {self._rank}: torch transport register() called twice")
        self._register_called = True
        check_register(self._rank, self._members, peers, direction)
        hellos = {peer: Hello(rank=self._rank, spec=spec, direction=direction) for peer, spec in peers.items()}
        replies = self._channel.exchange(hellos, Hello, HELLO_FRAME_BYTES)
        for peer, spec in peers.items():
            check_pairing(self._rank, peer, spec, direction, replies[peer].spec, replies[peer].direction)
        self._specs = dict(peers)
        self._direction = direction
        if direction != "send":
            self._recv_RD = {peer: spec.empty_features(self._device) for peer, spec in peers.items()}
        logger.debug("rank %d: torch transport registered peers %s (%s)", self._rank, sorted(peers), direction)

    def send(self, peer: int, payload: StepPayload) -> None:
        spec = self._spec(peer, "send")
        meta = check_payload(payload, spec, peer)
        self._channel.send(peer, meta, spec.meta_frame_bytes)
        if meta.num_rows:
            x_RD = payload.features_RD.contiguous()
            what = f"step {meta.step} features to rank {peer}"
            wait(start(lambda: dist.isend(x_RD, dst=peer, group=self._group), what), what)

    def recv(self, peer: int) -> StepPayload:
        spec = self._spec(peer, "recv")
        meta = self._channel.recv(peer, StepPayloadMeta, spec.meta_frame_bytes)
        check_meta(meta, spec, peer)
        x_RD = self._recv_RD[peer][: meta.num_rows]
        if meta.num_rows:
            what = f"step {meta.step} features from rank {peer}"
            wait(start(lambda: dist.irecv(x_RD, src=peer, group=self._group), what), what)
        return StepPayload(
            step=meta.step, features_RD=x_RD, accept_lens=meta.accept_lens, bonus_tokens=meta.bonus_tokens
        )

    def send_buffer(self, peer: int) -> torch.Tensor:
        """Allocated on the first call (isend reads any contiguous tensor in place, so none is needed before)."""
        spec = self._spec(peer, "send")
        if peer not in self._send_RD:
            self._send_RD[peer] = spec.empty_features(self._device)
        return self._send_RD[peer]

    def buffer_addresses(self) -> tuple[int, ...]:
        return tuple(self._recv_RD[peer].data_ptr() for peer in sorted(self._recv_RD))

    def close(self) -> None:
        self._channel.close()
        self._recv_RD.clear()
        self._send_RD.clear()
        self._specs.clear()

    def _spec(self, peer: int, doing: Direction) -> BufferSpec:
        return peer_spec(self._rank, self._specs, self._direction, peer, doing)
