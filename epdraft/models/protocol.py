"""DraftModel: what the runtime needs of a draft family, and the registry that builds one per spec.

A new family is a module with a class that has these methods, plus one line in `DRAFT_FAMILIES`
(keyed by `DraftModelSpec.kind`). The runtime and the loader only ever see this protocol.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from epdraft.dispatch import Dispatcher, StepPlan
from epdraft.layers.step_kernels import StepKernels
from epdraft.models.deepseek_dspark import DeepseekDSparkDraft
from epdraft.models.dflash import DFlashDraft, TargetHeads
from epdraft.models.dspark import DSparkDraft
from epdraft.models.kv_pool import RequestSlots
from epdraft.models.spec import DraftModelSpec
from epdraft.models.step import DraftStep
from epdraft.sampling import Readout


class DraftModel(Protocol):
    """One rank's draft as the runtime drives it: a KV pool of the requests' context, context
    extension into it, and the step. (An `nn.Module`: the runtime also walks its modules to name
    the MoE layer a lost peer left it in.)"""

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

    def new_pool(self, *, max_requests: int, max_context: int) -> RequestSlots:
        """The pool of the requests' context, allocated once, in the family's own layout (`KVPool`:
        k and v of every row; `WindowKVPool`: one K=V row of the last window rows)."""
        ...

    def extend(self, pool: RequestSlots, request_ids: Sequence[int], features: Sequence[torch.Tensor]) -> None:
        """Append each request's committed rows' target features [L_i, K*H] to its context (local, no FFN)."""
        ...

    def write_context(
        self, pool: RequestSlots, slots_N: torch.Tensor, counts_N: torch.Tensor, features_TF: torch.Tensor
    ) -> None:
        """`extend`'s device side: request i's counts_N[i] rows, packed in features_TF [T, K*H]
        (rows past their sum are padding), into slots_N's context, device lengths advanced; fixed
        shapes and no host sync, so a CUDA graph can hold it. The host's lengths are the caller's."""
        ...

    def step(
        self,
        pool: RequestSlots,
        slots_N: torch.Tensor,
        anchors_N: torch.Tensor,
        heads: TargetHeads,
        plan: StepPlan | None,
        *,
        readout: Readout = Readout.ARGMAX,
    ) -> DraftStep:
        """Drafts for N requests (N may be 0: every MoE layer still enters its collectives with
        `plan`), on the device, with no host sync: a CUDA graph can hold it. `readout`: argmax, or
        each draft sampled with its request's sampling and q returned (`DraftStep.probs_NKV`)."""
        ...

    def modules(self) -> Iterator[torch.nn.Module]: ...


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
    "dspark_v4": DeepseekDSparkDraft,
}
