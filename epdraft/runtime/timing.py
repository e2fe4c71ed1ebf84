"""Phase timers: where a run's time goes (prefill, verify, sync, draft context, draft step, MoE parts).

Phases never overlap in what they report: a phase opened inside another (an MoE layer inside the
draft step, a dispatch inside that layer) is booked to itself only and its time is taken out of
the enclosing phase, so the phases sum to the time spent inside any phase, never more, and
`wall - sum` is the time outside every phase (the summary's "other").

On CPU a phase is timed with the host clock. On CUDA each boundary records an event on the current
stream (no host clock around asynchronous work, no synchronize per phase); the events are read when
the totals are asked for, or, when many are pending, those the device has already passed. Under
CUDA graphs the draft step is one phase: a replay cannot be split by host-side boundaries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import defaultdict
from typing import Union

import torch

from epdraft.dispatch.base import Dispatched, Dispatcher
from epdraft.dispatch.plan import StepPlan

Mark = Union[float, torch.cuda.Event]

# Closed top-level phases kept before those already finished on the device are read (CUDA).
_MAX_PENDING = 4096


@dataclasses.dataclass
class _Span:
    """One phase occurrence: its boundaries and the phases opened inside it."""

    name: str
    start: Mark
    end: Mark | None = None
    children: list[_Span] = dataclasses.field(default_factory=list)


class PhaseTimers:
    """Exclusive seconds per phase name (nested phases subtracted from the phase around them)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self._cuda = torch.device(device).type == "cuda"
        self._seconds: dict[str, float] = defaultdict(float)
        self._open: list[_Span] = []
        self._pending: list[_Span] = []  # closed top-level spans whose CUDA events are not read yet

    def now(self) -> float:
        """Seconds on the host clock after the device finished its queued work: for a run's wall
        time (its start and end), never around a phase."""
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _mark(self) -> Mark:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, name: str) -> _Span:
        """Open phase `name` inside the innermost open phase (if any); close it with `stop`."""
        span = _Span(name, self._mark())
        if self._open:
            self._open[-1].children.append(span)
        self._open.append(span)
        return span

    def stop(self, span: _Span) -> None:
        """Close `span`, and any phase opened inside it and left open (a forward that raised)."""
        end = self._mark()
        while self._open:
            top = self._open.pop()
            top.end = end
            if top is span:
                break
        if not self._open:
            self._pending.append(span)
            if not self._cuda:
                self._read(lambda s: True)
            elif len(self._pending) > _MAX_PENDING:
                self._read(lambda s: s.end.query())

    @contextlib.contextmanager
    def phase(self, name: str):
        span = self.start(name)
        try:
            yield
        finally:
            self.stop(span)

    def _read(self, done) -> None:
        """Book the pending spans for which `done(span)` holds (in order, stopping at the first
        that does not), each with its own time less its children's."""
        n = 0
        while n < len(self._pending) and done(self._pending[n]):
            self._book(self._pending[n])
            n += 1
        del self._pending[:n]

    def _book(self, span: _Span) -> float:
        total = self._elapsed(span)
        self._seconds[span.name] += total - sum(self._book(child) for child in span.children)
        return total

    def _elapsed(self, span: _Span) -> float:
        if self._cuda:
            return span.start.elapsed_time(span.end) / 1000.0
        return span.end - span.start

    def as_dict(self) -> dict[str, float]:
        """Exclusive seconds per phase so far (on CUDA: one device synchronize, so every recorded
        event can be read)."""
        if self._pending and self._cuda:
            torch.cuda.synchronize()
        self._read(lambda s: True)
        return dict(self._seconds)


def time_forward(module: torch.nn.Module, timers: PhaseTimers, name: str) -> None:
    """Book every forward of `module` under `name` (less the phases opened inside it), through
    hooks: the module's code stays untouched."""
    spans: list[_Span] = []

    def pre(_module, _args):
        spans.append(timers.start(name))

    def post(_module, _args, _out):
        timers.stop(spans.pop())

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
