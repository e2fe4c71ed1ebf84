"""The dispatcher protocol: move rows to the ranks owning their experts and back; never compute.

`DraftMoE` composes a dispatcher with the experts:

    h = dispatcher.dispatch(x_TH, topk_ids_TK, topk_weights_TK, plan)   # h.rows_RH, h.ids_RK, h.weights_RK
    y_TH = dispatcher.combine(experts(h.rows_RH, h.ids_RK, h.weights_RK), h)

`ids_RK` are *local* expert ids in [0, e) of this rank; -1 marks a pair this rank must not compute
(another rank's expert, a padded row). The experts apply the weights and sum each row's pairs, so
combine only moves and adds rows.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import torch

from epdraft.dispatch.layout import MoeLayout
from epdraft.dispatch.plan import StepPlan
from epdraft.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Dispatched:
    """What dispatch hands to the experts (backends subclass it to carry their combine metadata).

    rows_RH: [R, H] rows to compute here, in x's dtype.
    ids_RK: [R, K'] int64 local expert ids, -1 = skip this pair.
    weights_RK: [R, K'] fp32 combine weights.
    num_tokens: T, the caller's row count (combine returns [T, H]).
    """

    rows_RH: torch.Tensor
    ids_RK: torch.Tensor
    weights_RK: torch.Tensor
    num_tokens: int


@runtime_checkable
class Dispatcher(Protocol):
    """Every rank of the MoE group calls dispatch and combine once per MoE layer per step, rows or not.

    `layout` is the rank's resolved MoeLayout: which experts it holds, which backend moves rows.
    """

    layout: MoeLayout

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, plan: StepPlan
    ) -> Dispatched:
        """Send this rank's token-expert pairs (global expert ids) to their owners."""
        ...

    def combine(self, expert_out_RH: torch.Tensor, handle: Dispatched) -> torch.Tensor:
        """Return [T, H]: each token's summed expert outputs, back at the rank that owns the token."""
        ...

    def close(self) -> None:
        """Free buffers this dispatcher allocated."""
        ...


class ReplicatedDispatcher:
    """Every rank holds every expert: no communication, ids are already local."""

    def __init__(self, layout: MoeLayout):
        if layout.group_size != 1:
            raise ConfigError(f"a replicated dispatcher needs a layout holding every expert, got ep {layout.ep_size} x tp {layout.tp_size}")
        self.layout = layout

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, plan: StepPlan | None = None
    ) -> Dispatched:
        return Dispatched(x_TH, topk_ids_TK, topk_weights_TK, x_TH.shape[0])

    def combine(self, expert_out_RH: torch.Tensor, handle: Dispatched) -> torch.Tensor:
        return expert_out_RH

    def close(self) -> None:
        pass
