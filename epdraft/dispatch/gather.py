"""`gather` layout: DP gather of every rank's rows around the experts, summed back with a reduce.

Every rank of the MoE group receives every rank's rows, computes its shard on all of them (EP: the
pairs routed to its experts; moe_tp: its slice F of each expert's intermediate dim, a partial sum)
and the reduction over the group completes each row and returns it to its owner.

- `max_len`: slices padded to the group max M, moved with all_gather_into_tensor; padded rows carry
  expert id -1 and are never computed; reduce-scatter returns each rank's M rows.
- `sum_len`: a zero-filled buffer of the exact total, own slot written, all-reduced; after the
  experts, an all-reduce and this rank's slice.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist

from epdraft.dispatch.base import Dispatched
from epdraft.dispatch.plan import StepPlan
from epdraft.dispatch.rows import group_counts, pack_route, unpack_route
from epdraft.dispatch.layout import MoeLayout

log = logging.getLogger(__name__)

# torch >= 2.13 renames these (same semantics); older releases only have the *_tensor names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclasses.dataclass(frozen=True)
class GatheredRows(Dispatched):
    """Dispatched rows of the whole group; `start`/`num_tokens` locate this rank's rows in them.

    `slot` is the padded per-rank length M under max_len, 0 under sum_len (and when the group had no rows).
    """

    start: int
    slot: int


def _has_reduce_scatter(group: dist.ProcessGroup) -> bool:
    """Whether `group`'s backend implements reduce_scatter_tensor (gloo gained it late).

    Probed once at construction by every rank of the group: a backend without it raises "does not
    support" locally on every rank before communicating, so the probe itself cannot hang.
    """
    if dist.get_backend(group) != dist.Backend.GLOO:
        return True
    size = dist.get_world_size(group)
    try:
        _reduce_scatter_single(torch.zeros(1), torch.zeros(size), group=group)
    except RuntimeError as e:
        if "does not support" not in str(e):
            raise
        return False
    return True


class GatherDispatcher:
    """DP gather/scatter around this rank's expert shard (EP experts and/or moe_tp slice)."""

    def __init__(self, layout: MoeLayout, group: dist.ProcessGroup):
        self.layout = layout
        self.group = group
        self.first_expert = layout.first_expert
        self.native_reduce_scatter = layout.dp_padding != "max_len" or _has_reduce_scatter(group)
        if not self.native_reduce_scatter:
            log.info("gloo group without reduce_scatter: max_len combine uses all_reduce + slice")

    @staticmethod
    def unsupported_reason(layout: MoeLayout, group: dist.ProcessGroup) -> str | None:
        """Every EP x moe_tp split and every process-group backend works."""
        return None

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, plan: StepPlan | None
    ) -> GatheredRows:
        """Gather the group's rows; ids become local (-1 for other ranks' experts and padding).

        Returns rows_RH [R, H] (R = G*M under max_len, the group total under sum_len) in x's
        dtype, ids_RK [R, K] int64, weights_RK [R, K] fp32.
        """
        T, H = x_TH.shape
        counts = group_counts(plan, self.group, T)
        g = dist.get_rank(self.group)
        route_T2K = pack_route(topk_ids_TK, topk_weights_TK)
        if sum(counts) == 0:  # the whole group agrees (same plan): no collective
            rows_RH, route_R2K, start, slot = x_TH, route_T2K, 0, 0
        elif self.layout.dp_padding == "max_len":
            slot = max(counts)
            start = g * slot
            x_MH = x_TH.new_zeros(slot, H)
            x_MH[:T] = x_TH
            route_M2K = route_T2K.new_zeros(slot, route_T2K.shape[1])
            route_M2K[T:, : topk_ids_TK.shape[1]] = -1  # padded rows: never computed
            route_M2K[:T] = route_T2K
            rows_RH = x_TH.new_empty(len(counts) * slot, H)
            route_R2K = route_T2K.new_empty(len(counts) * slot, route_T2K.shape[1])
            _all_gather_single(rows_RH, x_MH, group=self.group)
            _all_gather_single(route_R2K, route_M2K, group=self.group)
        else:
            slot = 0
            start = sum(counts[:g])
            rows_RH = x_TH.new_zeros(sum(counts), H)
            route_R2K = route_T2K.new_zeros(sum(counts), route_T2K.shape[1])
            rows_RH[start : start + T] = x_TH
            route_R2K[start : start + T] = route_T2K
            dist.all_reduce(rows_RH, group=self.group)
            dist.all_reduce(route_R2K, group=self.group)
        ids_RK, weights_RK = unpack_route(route_R2K, self.first_expert, self.layout.num_local_experts)
        return GatheredRows(rows_RH, ids_RK, weights_RK, T, start=start, slot=slot)

    def combine(self, expert_out_RH: torch.Tensor, handle: Dispatched) -> torch.Tensor:
        """Sum every rank's partial outputs and return this rank's [T, H] (reduces expert_out in place
        under sum_len and the all-reduce fallback)."""
        assert isinstance(handle, GatheredRows), type(handle)
        T = handle.num_tokens
        if expert_out_RH.shape[0] == 0:  # the whole group had 0 rows: dispatch skipped the collectives too
            return expert_out_RH
        if handle.slot == 0:
            dist.all_reduce(expert_out_RH, group=self.group)
            return expert_out_RH[handle.start : handle.start + T]
        if self.native_reduce_scatter:
            out_MH = expert_out_RH.new_empty(handle.slot, expert_out_RH.shape[1])
            _reduce_scatter_single(out_MH, expert_out_RH, group=self.group)
            return out_MH[:T]
        # gloo without reduce_scatter_tensor: the same sum through all_reduce, then this rank's slot.
        dist.all_reduce(expert_out_RH, group=self.group)
        return expert_out_RH[handle.start : handle.start + T]

    def close(self) -> None:
        """Nothing to free: buffers are per call."""
