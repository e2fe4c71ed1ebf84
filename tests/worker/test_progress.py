"""The terminal progress line: drawn in place on a terminal, one final line per phase, nothing elsewhere."""

from __future__ import annotations

import io

from epdraft.worker import progress
from epdraft.worker.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_each_phase_ends_in_one_line_with_its_count_and_time(monkeypatch):
    clock = iter(range(0, 1000, 1))
    monkeypatch.setattr(progress.time, "monotonic", lambda: float(next(clock)))
    out = _Terminal()
    display = Progress(out)
    display.phase("loading the target")
    display.phase("prefill", 4, "prompts")
    for n in range(1, 5):
        display.update(n)
    display.phase("decoding", 100, "tokens")
    display.update(40)
    display.close()
    lines = [line.rsplit("\r\x1b[K", 1)[-1] for line in out.getvalue().split("\n")]
    assert lines[0].startswith("loading the target (") and lines[0].endswith(" s)"), lines
    assert lines[1].startswith("prefill: 4/4 prompts, ") and "prompts/s" in lines[1], lines
    assert lines[2].startswith("decoding: 40/100 tokens, ") and "left" not in lines[2], lines
    assert "decoding: 40/100 tokens" in out.getvalue() and " left" in out.getvalue()  # while running: the ETA
    assert lines[3] == ""


def test_nothing_is_drawn_off_a_terminal_or_off_rank_0():
    out = io.StringIO()
    display = Progress(out)
    display.phase("prefill", 2, "prompts")
    display.update(1)
    display.close()
    assert not display.enabled and out.getvalue() == ""
    assert not Progress.for_rank(1).enabled
