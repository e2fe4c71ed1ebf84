"""DraftModel: what the runtime needs of a draft family, and the registry that builds one per spec.

A new family is a module with a class that has these methods, plus one line in `DRAFT_FAMILIES`
(keyed by `DraftModelSpec.kind`). The runtime and the loader only ever see this protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from epdraft.dispatch import Dispatcher, StepPlan
from epdraft.layers.step_kernels import StepKernels
from epdraft.models.cache import DraftCache
from epdraft.models.dflash import DFlashDraft, TargetHeads
from epdraft.models.dspark import DSparkDraft
from epdraft.models.spec import DraftModelSpec


class DraftModel(Protocol):
    """One rank's draft: per-request context caches, context extension, and the block proposal."""

    spec: DraftModelSpec
    kernels: StepKernels
    """Which implementation runs each op of the step (resolved once per rank)."""

    @property
    def block_size(self) -> int:
        """B: the block the draft proposes (the anchor plus B-1 drafts)."""
        ...

    @property
    def num_drafts(self) -> int:
        """Drafts per request per step: B-1 (mask-filling readout) or B (autoregressive); verify width num_drafts + 1."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the draft's weights live."""
        ...

    def new_cache(self) -> DraftCache:
        """An empty context for one request."""
        ...

    def extend_contexts(self, caches: Sequence[DraftCache], features: Sequence[torch.Tensor]) -> None:
        """Append each request's committed rows' target features [L_i, K*H] to its context (local, no FFN)."""
        ...

    def propose(
        self, caches: list[DraftCache], anchors_N: torch.Tensor, heads: TargetHeads, plan: StepPlan | None
    ) -> torch.Tensor:
        """[N, num_drafts] int64 drafts; N may be 0, every MoE layer still enters its collectives with `plan`."""
        ...


class DraftFamily(Protocol):
    """A draft class: built from its spec, placed by a dispatcher, computing as the rank's
    `StepKernels` say, weights loaded afterwards."""

    def __call__(
        self,
        spec: DraftModelSpec,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        dispatcher: Dispatcher | None,
        kernels: StepKernels | None,
    ) -> DraftModel: ...


DRAFT_FAMILIES: dict[str, DraftFamily] = {
    "dflash": DFlashDraft,
    "dspark": DSparkDraft,
}
