"""PhaseTimers on the host clock: nested phases are booked exclusively, so the phases never sum to
more than the wall time around them (the bug: 1.9 s of phases in a 0.74 s run)."""

from __future__ import annotations

import time

import torch

from epdraft.runtime.timing import PhaseTimers, time_forward


def _near(got: float, expected: float) -> bool:
    """At least `expected` (busy waits never end early), at most 25 ms more (a loaded host): far
    below what booking a nested phase in its parent too would add."""
    return expected - 1e-4 <= got < expected + 0.025


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_nested_phases_are_exclusive_and_sum_to_the_time_inside_phases():
    timers = PhaseTimers()
    wall_start = time.perf_counter()
    with timers.phase("outer"):
        _busy(0.02)
        with timers.phase("inner"):
            _busy(0.03)
            with timers.phase("innermost"):
                _busy(0.03)
        _busy(0.02)
    _busy(0.02)  # outside every phase
    with timers.phase("inner"):
        _busy(0.01)
    wall = time.perf_counter() - wall_start
    got = timers.as_dict()
    assert _near(got["outer"], 0.04) and _near(got["inner"], 0.04) and _near(got["innermost"], 0.03)
    assert sum(got.values()) <= wall
    assert wall - sum(got.values()) >= 0.02


def test_module_hooks_nest_inside_the_phase_around_the_call():
    class Slow(torch.nn.Module):
        def forward(self, x):
            _busy(0.03)
            return x

    timers = PhaseTimers()
    layer = Slow()
    time_forward(layer, timers, "layer")
    with timers.phase("step"):
        _busy(0.02)
        layer(torch.zeros(1))
        layer(torch.zeros(1))
    got = timers.as_dict()
    assert _near(got["layer"], 0.06) and _near(got["step"], 0.02)


def test_a_phase_left_open_by_an_exception_is_closed_with_its_parent():
    timers = PhaseTimers()
    outer = timers.start("outer")
    timers.start("inner")  # a forward pre-hook whose forward raised: never stopped
    _busy(0.03)
    timers.stop(outer)
    with timers.phase("next"):  # a top-level phase again, not a child of the stale one
        _busy(0.01)
    got = timers.as_dict()
    assert set(got) == {"outer", "inner", "next"}
    assert _near(got["inner"], 0.03) and got["outer"] < 0.02
    assert _near(got["next"], 0.01)
