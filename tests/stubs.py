"""Dispatchers for single-process tests: a rank's expert shard without any process group."""

from __future__ import annotations

import torch

from epdraft.config.ffn import DraftMoeFFNSpec
from epdraft.dispatch.base import Dispatched
from epdraft.dispatch.layout import MoeLayout


def shard_layout(
    spec: DraftMoeFFNSpec, hidden_size: int, *, ep_rank: int = 0, ep_size: int = 1, tp_rank: int = 0, tp_size: int = 1
) -> MoeLayout:
    """A gather layout placing one rank's shard of `spec`'s experts (nothing here communicates)."""
    return MoeLayout(
        layout="gather", num_experts=spec.num_experts, hidden_size=hidden_size, top_k=spec.top_k,
        ep_rank=ep_rank, ep_size=ep_size, tp_rank=tp_rank, tp_size=tp_size,
    )  # fmt: skip


class LocalIdsDispatcher:
    """One shard without communication: this rank's own tokens, global ids mapped to local ids (-1 = other rank)."""

    def __init__(self, layout: MoeLayout) -> None:
        self.layout = layout

    def dispatch(self, x_TH, topk_ids_TK, topk_weights_TK, plan=None) -> Dispatched:
        first, count = self.layout.first_expert, self.layout.num_local_experts
        local_TK = topk_ids_TK - first
        local_TK = torch.where((local_TK >= 0) & (local_TK < count), local_TK, -1)
        return Dispatched(x_TH, local_TK, topk_weights_TK, x_TH.shape[0])

    def combine(self, expert_out_RH: torch.Tensor, handle: Dispatched) -> torch.Tensor:
        return expert_out_RH

    def close(self) -> None:
        pass
