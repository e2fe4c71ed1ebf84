"""A one-line progress display for `epdraft run`'s long phases, on rank 0 when stdout is a terminal.

Loading, prefill, decoding and the lossless check of a large prompt file take minutes; a terminal
shows where the run is (`decoding: 51200/640000 tokens, 2410 tok/s, 4 min left`), redrawn in place at
most twice a second. Anything else (a file, a pipe, CI) gets no display: the log says the same.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_REDRAW_S = 0.5


class Progress:
    """One phase at a time: `phase(label, total, unit)`, then `update(done)`, then the next phase or `close()`.

    stream: where to draw; None, or a stream that is not a terminal, disables every method.
    """

    def __init__(self, stream: TextIO | None):
        self.stream = stream if stream is not None and stream.isatty() else None
        self._label, self._total, self._unit = "", None, ""
        self._start = self._drawn_at = 0.0
        self._done = 0

    @classmethod
    def for_rank(cls, rank: int) -> Progress:
        """Rank 0 draws on stdout (when a terminal); every other rank draws nothing."""
        return cls(sys.stdout if rank == 0 else None)

    @property
    def enabled(self) -> bool:
        return self.stream is not None

    def phase(self, label: str, total: int | None = None, unit: str = "") -> None:
        """End the current phase's line and start `label` (`total` units of work, when known)."""
        if self.stream is None:
            return
        self._end_line()
        self._label, self._total, self._unit, self._done = label, total, unit, 0
        self._start = time.monotonic()
        self._draw()

    def update(self, done: int) -> None:
        """`done` units of the phase are finished (redrawn only every half second)."""
        if self.stream is None:
            return
        self._done = min(done, self._total) if self._total else done  # a last verify may emit past the total
        if time.monotonic() - self._drawn_at >= _REDRAW_S:
            self._draw()

    def close(self) -> None:
        """End the last phase's line."""
        if self.stream is not None:
            self._end_line()
            self._label = ""

    def _end_line(self) -> None:
        if self._label:
            self._draw(final=True)
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, final: bool = False) -> None:
        elapsed = time.monotonic() - self._start
        text = self._label
        if not self._total and self._unit:
            text += f": {self._done} {self._unit}"
        elif self._total:
            text += f": {self._done}/{self._total} {self._unit}".rstrip()
            rate = self._done / elapsed if elapsed > 0 else 0.0
            if rate > 0:
                text += f", {rate:.0f} {self._unit or 'units'}/s"
                if not final and self._done < self._total:
                    text += f", {_duration((self._total - self._done) / rate)} left"
        text += f" ({_duration(elapsed)})" if final else ""
        self.stream.write("\r\x1b[K" + text)
        self.stream.flush()
        self._drawn_at = time.monotonic()


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
