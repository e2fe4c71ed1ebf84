"""MoeContext: how a DraftMoE is placed (which experts, which intermediate slice) and how it talks."""

from __future__ import annotations

import dataclasses

from epdraft.dispatch.base import Dispatcher, ReplicatedDispatcher
from epdraft.dispatch.plan import StepPlan
from epdraft.errors import ParallelError


@dataclasses.dataclass
class MoeContext:
    """Runtime placement of the MoE layers of one rank, shared by all its DraftMoE modules.

    EP rank r holds experts [r*e, (r+1)*e) with e = E / ep_size; TP rank t holds intermediate rows
    [t*F, (t+1)*F) of every expert it holds, F = I / tp_size. Within the MoE group, group rank
    g = ep_rank * tp_size + tp_rank. `plan` is set once per step by the worker (`begin_step`)
    before any layer runs, so every layer of the step dispatches with the same agreed counts.
    """

    ep_rank: int = 0
    ep_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    dispatcher: Dispatcher = dataclasses.field(default_factory=ReplicatedDispatcher)
    plan: StepPlan | None = None

    def begin_step(self, plan: StepPlan) -> None:
        """Set the agreed plan every MoE layer of this step dispatches with."""
        self.plan = plan

    def current_plan(self) -> StepPlan | None:
        """This step's plan; ParallelError if a communicating layout runs before `begin_step`."""
        if self.plan is None and not isinstance(self.dispatcher, ReplicatedDispatcher):
            raise ParallelError("DraftMoE ran before MoeContext.begin_step(plan): the step's row counts are unknown")
        return self.plan
