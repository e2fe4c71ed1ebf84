"""StepPlan: the one piece of per-step metadata every rank agrees on before any MoE collective."""

from __future__ import annotations

import msgspec


class StepPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Every rank's row count for one step, as gathered by one collective (`epdraft.runtime.coordinator`).

    `ranks` are the global ranks of the sync group in group order; `counts[i]` is the row count of
    `ranks[i]`. Plain data: `epdraft.runtime` builds it, `epdraft.dispatch` only reads it, so every
    rank takes the same branch (skip, pad length, buffer sizes) from the same numbers.
    `extras[i]` are the caller's extra ints of `ranks[i]`, gathered in the same collective.
    """

    step: int
    ranks: tuple[int, ...]
    counts: tuple[int, ...]
    extras: tuple[tuple[int, ...], ...] = ()

    @property
    def total(self) -> int:
        return sum(self.counts)

    @property
    def max_count(self) -> int:
        return max(self.counts, default=0)

    @property
    def skip(self) -> bool:
        """True when no rank has rows: every rank skips the draft step together."""
        return self.total == 0

    def counts_of(self, ranks: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        """Row counts of the given global ranks (e.g. the members of one MoE group), in that order."""
        index = {r: i for i, r in enumerate(self.ranks)}
        return tuple(self.counts[index[r]] for r in ranks)
