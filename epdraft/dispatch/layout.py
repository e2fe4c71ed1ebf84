"""MoeLayout: how one rank's draft MoE layers run, resolved once per rank before step 0.

Everything that depends on `draft.moe_layout` reads this one value: the dispatcher factory (which
backend, padding, fixed-buffer capacity, low-latency mode), `DraftMoE` and the loader (which
experts and which intermediate slice this rank holds), and the run summary (the label, the
planner's reason). It is plain data, like `StepPlan`: the runtime resolves it, the layers below
only read it, so none of them imports the runtime.

    layout = MoeLayout.resolve(parallel_config, draft_spec.ffn, groups)   # every (config, draft) check here
    dispatcher = make_dispatcher(layout, groups.moe)                       # the backend's check here

Whether the backend can run on this rank's group is asked by `make_dispatcher` alone, not here:
only the factory knows the backends, and the factory imports this module, so asking from here
would make the two import each other.
"""

from __future__ import annotations

import logging
from typing import Literal, Protocol

import msgspec
import torch.distributed as dist

import epdraft.dispatch.planner as planner  # the module, not the package (whose __init__ imports this file)
from epdraft.config.ffn import DraftMoeFFNSpec
from epdraft.config.hf import DraftMixFFNSpec
from epdraft.config.parallel import ParallelConfig, check_moe_split, fixed_row_buffers
from epdraft.errors import ConfigError

log = logging.getLogger(__name__)

DpPadding = Literal["max_len", "sum_len"]
"""`max_len`: every rank's slice padded to the group max (one all-gather, one reduce-scatter).
`sum_len`: a buffer of exactly the group total (zero-filled, own slot written, all-reduced)."""


class MoeCoordinates(Protocol):
    """What `resolve` reads of the draft's groups (`epdraft.parallel.Groups` provides it)."""

    ep_rank: int
    ep_size: int
    tp_rank: int
    tp_size: int
    device_type: str
    moe: dist.ProcessGroup | None


class MoeLayout(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's resolved MoE layout.

    layout: "replicated" | "alltoall" | "gather" (never "auto": `resolve` asks the planner).
    backend: the all-to-all backend ("torch", "deepep", "mooncake"); "torch" for the other layouts.
    dp_padding: gather's padding (see `DpPadding`).
    low_latency: DeepEP's fixed-buffer low-latency kernels instead of its normal ones.
    max_rows_per_rank: rows per rank per step that fixed-buffer backends size their buffers for.
    ep_rank / ep_size / tp_rank / tp_size: this rank's place in the MoE group (group rank
        g = ep_rank * tp_size + tp_rank); EP rank r holds experts [r*e, (r+1)*e), e = E / ep_size,
        TP rank t rows [t*F, (t+1)*F) of each expert's intermediate dim, F = I / tp_size.
        Replicated: 0 of 1 on both axes, whatever the groups.
    num_experts / hidden_size / top_k: what every MoE layer of the draft moves (one dispatcher
        serves them all, so they must agree).
    device_type: "cpu" | "cuda", where the experts run.
    chosen_by_auto / reason: whether `auto` picked the layout, and the planner's one-line why.
    """

    layout: Literal["replicated", "alltoall", "gather"]
    backend: str = "torch"
    dp_padding: DpPadding = "max_len"
    low_latency: bool = False
    max_rows_per_rank: int = 0
    ep_rank: int = 0
    ep_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    num_experts: int
    hidden_size: int
    top_k: int
    device_type: str = "cpu"
    chosen_by_auto: bool = False
    reason: str | None = None

    @classmethod
    def local(cls, num_experts: int, hidden_size: int, top_k: int, **kwargs) -> MoeLayout:
        """Every expert on this rank, no communication (a single process, tests, `replicated`)."""
        return cls(layout="replicated", num_experts=num_experts, hidden_size=hidden_size, top_k=top_k, **kwargs)

    @classmethod
    def resolve(cls, pc: ParallelConfig, ffn: DraftMixFFNSpec, groups: MoeCoordinates) -> MoeLayout:
        """The layout `pc.draft` asks for, for this draft on this rank, checked against the draft.

        `auto` runs the planner here (once). A draft with no MoE layer is `replicated`.
        Raises ConfigError naming the key when the draft and the config do not fit together:
        moe_ep must divide E, moe_tp must divide every layer's I, all MoE layers must move the
        same E and top_k. Whether the chosen backend can run on `groups.moe` is `make_dispatcher`'s
        check (the runtime builds the dispatcher right after resolving, before loading weights).
        """
        d = pc.draft
        moe_layers = [layer for layer in ffn.layers if isinstance(layer, DraftMoeFFNSpec)]
        if not moe_layers:
            return cls.local(0, ffn.hidden_size, 0, device_type=groups.device_type)
        first = moe_layers[0]
        for i, layer in zip(ffn.moe_layers, moe_layers):
            if (layer.num_experts, layer.top_k) != (first.num_experts, first.top_k):
                raise ConfigError(
                    f"layer {i}: {layer.num_experts} experts top-{layer.top_k}, layer {ffn.moe_layers[0]}: "
                    f"{first.num_experts} top-{first.top_k}; one dispatcher serves every MoE layer, they must agree"
                )
        layout, padding, reason = d.moe_layout, d.dp_padding, None
        if layout == "auto":
            choice = planner.choose_for_config(pc, ffn)
            layout, padding, reason = choice.layout, choice.dp_padding, choice.reason
            log.info("draft.moe_layout = 'auto' -> %s", reason)
        facts = dict(
            num_experts=first.num_experts, hidden_size=ffn.hidden_size, top_k=first.top_k,
            device_type=groups.device_type, chosen_by_auto=d.moe_layout == "auto",
            reason=reason,
        )  # fmt: skip
        if layout == "replicated":
            return cls.local(**facts)
        check_moe_split(pc, ffn)
        return cls(
            layout=layout,
            backend=d.a2a_backend if layout == "alltoall" else "torch",
            dp_padding=padding,
            low_latency=d.low_latency,
            max_rows_per_rank=d.max_rows_per_rank,
            ep_rank=groups.ep_rank,
            ep_size=groups.ep_size,
            tp_rank=groups.tp_rank,
            tp_size=groups.tp_size,
            **facts,
        )

    @property
    def capturable(self) -> bool:
        """Whether this layout's dispatch has shapes fixed by the plan and no host sync (CUDA-graph safe)."""
        if self.layout != "alltoall":
            return True
        return self.backend == "torch_fixed" or (self.backend == "deepep" and self.low_latency)

    @property
    def row_cap(self) -> int | None:
        """The most rows one rank may send in a step where the backend's buffers are sized once
        (DeepEP low-latency, Mooncake EP): `max_rows_per_rank`; None where any count goes."""
        fixed = self.layout == "alltoall" and fixed_row_buffers(self.backend, self.low_latency)
        return self.max_rows_per_rank if fixed else None

    @property
    def group_size(self) -> int:
        """Ranks of the MoE group: ep_size x tp_size."""
        return self.ep_size * self.tp_size

    @property
    def num_local_experts(self) -> int:
        """e: experts held by this rank."""
        return self.num_experts // self.ep_size

    @property
    def first_expert(self) -> int:
        """Global id of this rank's first expert."""
        return self.ep_rank * self.num_local_experts

    @property
    def label(self) -> str:
        """The layout as it runs, for logs and the run summary: `gather (max_len)`, `alltoall (deepep, low-latency)`."""
        if self.layout == "gather":
            label = f"gather ({self.dp_padding})"
        elif self.layout == "alltoall" and (self.backend != "torch" or self.low_latency):
            label = f"alltoall ({self.backend}{', low-latency' if self.low_latency else ''})"
        else:
            label = self.layout
        return f"{label}, chosen by auto" if self.chosen_by_auto else label
