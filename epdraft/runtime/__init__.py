"""epdraft.runtime: what a serving engine embeds, per DP rank.

`DraftRuntime` (the draft, its caches and the step's sync), the `StepCoordinator` (one collective
per step -> `StepPlan`), `MoeLayout` (resolved once per rank; defined with the dispatchers, which
read it) and the phase timers.
"""

from epdraft.dispatch.layout import MoeLayout
from epdraft.dispatch.plan import StepPlan
from epdraft.runtime.coordinator import StepCoordinator
from epdraft.runtime.draft import DraftRuntime, Proposal
from epdraft.runtime.timing import PhaseTimers

__all__ = ["DraftRuntime", "MoeLayout", "PhaseTimers", "Proposal", "StepCoordinator", "StepPlan"]
