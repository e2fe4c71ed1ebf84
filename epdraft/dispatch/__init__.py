"""epdraft.dispatch: move MoE rows to the ranks holding their experts and back (never compute).

Layouts: `replicated` (no communication), `gather` (DP gather/scatter, `max_len` | `sum_len`),
`alltoall` (backends `torch`, `deepep`, `mooncake`). `MoeLayout.resolve` decides which one runs
(the planner resolves `auto`), `make_dispatcher` is the only place that knows them all.
"""

from epdraft.dispatch.base import Dispatched, Dispatcher, ReplicatedDispatcher
from epdraft.dispatch.factory import make_dispatcher
from epdraft.dispatch.layout import MoeLayout
from epdraft.dispatch.plan import StepPlan

__all__ = ["Dispatched", "Dispatcher", "MoeLayout", "ReplicatedDispatcher", "StepPlan", "make_dispatcher"]
