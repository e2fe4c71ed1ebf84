"""DraftStep: what one draft step hands back, all of it on the draft's device (no host sync)."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class DraftStep:
    """One step's output for N requests.

    drafts_NK: [N, num_drafts] int64 drafted tokens.
    finite_L: [num_layers] bool, whether each draft layer's output stayed finite (the caller reads
        it once, after reading the drafts anyway: `check_finite`).
    confidence_NK: [N, num_drafts] fp32, each draft's predicted accept probability (a DSpark draft
        with a confidence head), else None.
    probs_NKV: [N, num_drafts, V] fp32, the proposal distribution q each draft was sampled from
        (a sampled step; one-hot rows for its greedy requests), else None (a greedy step).
    """

    drafts_NK: torch.Tensor
    finite_L: torch.Tensor
    confidence_NK: torch.Tensor | None = None
    probs_NKV: torch.Tensor | None = None

    def first(self, n: int) -> DraftStep:
        """The first `n` requests' rows (a padded batch's real requests; views, no copy)."""
        confidence = self.confidence_NK[:n] if self.confidence_NK is not None else None
        probs = self.probs_NKV[:n] if self.probs_NKV is not None else None
        return DraftStep(self.drafts_NK[:n], self.finite_L, confidence, probs)
