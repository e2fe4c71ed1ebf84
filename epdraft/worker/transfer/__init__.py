"""Hidden-state transport between paired ranks: one protocol, torch p2p and Mooncake backends.

Only `make_transport` knows every backend; Mooncake is imported when its transport is built.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from epdraft.errors import ConfigError
from epdraft.worker.transfer.base import BufferSpec, StepPayload, StepPayloadMeta, Transport
from epdraft.worker.transfer.mooncake import unavailable_reason as mooncake_unavailable_reason

TRANSPORTS = ("torch", "mooncake")

__all__ = [
    "TRANSPORTS",
    "BufferSpec",
    "StepPayload",
    "StepPayloadMeta",
    "Transport",
    "make_transport",
    "mooncake_unavailable_reason",
]


def make_transport(
    kind: str,
    group: dist.ProcessGroup,
    *,
    device: torch.device | str = "cpu",
    hostname: str = "127.0.0.1",
    device_name: str = "",
) -> Transport:
    """Build the `kind` transport on `group` ("torch": gloo/NCCL p2p; "mooncake": needs a gloo group).

    hostname and device_name are Mooncake's: this rank's address as peers reach it, and the RDMA
    HCA allow-list ("" = all).
    """
    if kind == "torch":
        from epdraft.worker.transfer.torch_p2p import TorchP2PTransport

        return TorchP2PTransport(group, device=device)
    if kind == "mooncake":
        from epdraft.worker.transfer.mooncake import MooncakeTransport

        return MooncakeTransport(group, hostname=hostname, device=device, device_name=device_name)
    raise ConfigError(f"transfer = {kind!r} must be one of {list(TRANSPORTS)}")
