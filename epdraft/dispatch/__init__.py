"""epdraft.dispatch: move MoE rows to the ranks holding their experts and back (never compute).

Layouts: `replicated` (no communication), `gather` (DP gather/scatter, `max_len` | `sum_len`),
`alltoall` (backends `torch`, `deepep`, `mooncake`); `make_dispatcher` is the only place that
knows them all, `epdraft.dispatch.planner.choose_layout` resolves `auto`.
"""

from epdraft.dispatch.base import Dispatched, Dispatcher, ReplicatedDispatcher
from epdraft.dispatch.factory import make_dispatcher
from epdraft.dispatch.plan import StepPlan
from epdraft.dispatch.setup import DispatchSetup

__all__ = ["DispatchSetup", "Dispatched", "Dispatcher", "ReplicatedDispatcher", "StepPlan", "make_dispatcher"]
