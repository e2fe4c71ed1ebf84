"""DispatchSetup: the static facts every dispatcher is sized and checked against."""

from __future__ import annotations

from typing import Literal

import msgspec
import torch.distributed as dist

DpPadding = Literal["max_len", "sum_len"]
"""`max_len`: every rank's slice padded to the group max (one all-gather, one reduce-scatter).
`sum_len`: a buffer of exactly the group total (zero-filled, own slot written, all-reduced)."""


class DispatchSetup(msgspec.Struct, frozen=True, kw_only=True):
    """What one MoE layer's dispatcher moves, and over how many ranks.

    The MoE group has ep_size * tp_size ranks; group rank g = ep_rank * tp_size + tp_rank (the
    order `epdraft.worker.groups` builds). EP rank r holds experts [r*e, (r+1)*e), e = E / ep_size.
    `max_tokens_per_rank` sizes fixed buffers (DeepEP low-latency, Mooncake); 0 = not bounded.
    `low_latency` picks DeepEP's fixed-buffer kernels (no CPU sync, CUDA-graph capturable).
    """

    num_experts: int
    hidden_size: int
    ep_size: int
    tp_size: int
    top_k: int = 0
    dp_padding: DpPadding = "max_len"
    max_tokens_per_rank: int = 0
    low_latency: bool = False

    @property
    def group_size(self) -> int:
        return self.ep_size * self.tp_size

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def placement(self, group: dist.ProcessGroup) -> tuple[int, int]:
        """(ep_rank, tp_rank) of the calling process inside `group`."""
        g = dist.get_rank(group)
        return g // self.tp_size, g % self.tp_size
