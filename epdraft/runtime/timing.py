"""Phase timers: where a step's time goes (verify, sync, draft attention, MoE dispatch/experts/combine).

On CUDA a phase boundary synchronizes the device so the wall time is the phase's GPU time; that
costs a little overlap, which is why the timers are only attached when a run asks for the split.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

from epdraft.dispatch.base import Dispatched, Dispatcher
from epdraft.dispatch.plan import StepPlan


class PhaseTimers:
    """Accumulated seconds per phase name."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.seconds: dict[str, float] = defaultdict(float)
        self._cuda = torch.device(device).type == "cuda"

    def now(self) -> float:
        """Seconds on the wall clock, after the device finished its queued work."""
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str):
        start = self.now()
        try:
            yield
        finally:
            self.seconds[name] += self.now() - start

    def as_dict(self) -> dict[str, float]:
        return dict(self.seconds)


def time_forward(module: torch.nn.Module, timers: PhaseTimers, name: str) -> None:
    """Book every forward of `module` under `name`, through hooks: the module's code stays untouched."""
    starts: list[float] = []

    def pre(_module, _args):
        starts.append(timers.now())

    def post(_module, _args, _out):
        timers.seconds[name] += timers.now() - starts.pop()

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


class TimedDispatcher:
    """A dispatcher wrapper that books dispatch and combine under `moe_dispatch` / `moe_combine`."""

    def __init__(self, inner: Dispatcher, timers: PhaseTimers):
        self.inner = inner
        self.timers = timers
        self.layout = inner.layout

    def dispatch(self, x_TH, topk_ids_TK, topk_weights_TK, plan: StepPlan) -> Dispatched:
        with self.timers.phase("moe_dispatch"):
            return self.inner.dispatch(x_TH, topk_ids_TK, topk_weights_TK, plan)

    def combine(self, expert_out_RH, handle: Dispatched):
        with self.timers.phase("moe_combine"):
            return self.inner.combine(expert_out_RH, handle)

    def close(self) -> None:
        self.inner.close()
