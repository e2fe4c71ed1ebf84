"""`alltoall` layout, `torch_fixed` backend: one fixed-size all-to-all per direction.

The exact path (`alltoall.py`) exchanges per-destination counts first and reads them on the host
(a sync per layer), then moves rows and routes with variable splits: three collectives. Here the
step's plan already says how many rows every rank has, so each rank sends every peer a slab of
C = the group's largest row count this step: a token's row goes to the slab of each rank owning
one of its experts, packed to the front; the rest of the slab is padding routed nowhere (ids -1).
Rows and routes travel in one byte tensor, so dispatch and combine are one equal-split
all_to_all_single each, with no host sync and shapes fixed by the plan: the path a captured
(CUDA-graph) step can use. It sends G*C rows where the exact path sends only the rows needed.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from epdraft.dispatch.alltoall import AllToAllDispatcher
from epdraft.dispatch.base import Dispatched
from epdraft.dispatch.plan import StepPlan
from epdraft.dispatch.rows import group_counts, pack_route, unpack_route


@dataclasses.dataclass(frozen=True)
class SlabRows(Dispatched):
    """Rows received in G slabs of C rows, plus where each of this rank's tokens went.

    slot_GT: [G, T] int64, the slab row token t took in the slab sent to rank d, or C (the dump
        row) where t was not sent to d. capacity: C.
    """

    slot_GT: torch.Tensor
    capacity: int


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[N, X] of any dtype as [N, X * itemsize] uint8 (a view), so rows and routes share one collective."""
    return t.contiguous().view(torch.uint8).view(t.shape[0], -1)


class FixedAllToAllDispatcher(AllToAllDispatcher):
    """Equal-split all_to_all_single dispatch/combine over the EP group (whole experts per rank,
    moe_tp = 1): the exact dispatcher's placement and checks, its own two collectives."""

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, plan: StepPlan | None
    ) -> SlabRows:
        """Send each token to the slabs of the ranks owning its experts.

        Returns rows_RH [G*C, H] in x's dtype (padding rows are zeros), ids_RK [G*C, K] local ids
        (-1 = another rank's pair or padding), weights_RK [G*C, K] fp32.
        """
        T, H = x_TH.shape
        K = topk_ids_TK.shape[1]
        G, C = self.group_size, max(group_counts(plan, self.group, T))
        e = self.layout.num_local_experts
        device = x_TH.device
        empty_slots = torch.zeros(G, T, dtype=torch.int64, device=device)
        if C == 0:  # the whole group agrees (same plan): no collective
            ids_RK, weights_RK = unpack_route(pack_route(topk_ids_TK, topk_weights_TK), self.first_expert, e)
            return SlabRows(x_TH, ids_RK, weights_RK, T, slot_GT=empty_slots, capacity=0)
        owner_TK = topk_ids_TK // e
        ranks_G = torch.arange(G, device=device)
        sends_GT = (owner_TK.unsqueeze(0) == ranks_G.view(-1, 1, 1)).any(dim=-1)
        slot_GT = torch.where(sends_GT, sends_GT.long().cumsum(dim=1) - 1, C)
        # Each slab row carries only the pairs its destination owns; the others become -1 there.
        keep_GTK = owner_TK.unsqueeze(0) == ranks_G.view(-1, 1, 1)
        ids_GTK = torch.where(keep_GTK, topk_ids_TK.unsqueeze(0), -1)
        route_GT2K = torch.cat([ids_GTK.float(), topk_weights_TK.float().unsqueeze(0).expand(G, -1, -1)], dim=2)
        # Slabs with one extra dump row (index C) that absorbs the tokens not sent to a rank.
        send_x = x_TH.new_zeros(G, C + 1, H)
        send_route = route_GT2K.new_zeros(G, C + 1, 2 * K)
        send_route[:, :, :K] = -1
        flat_GT = (ranks_G.view(-1, 1) * (C + 1) + slot_GT).view(-1)
        send_x.view(-1, H).index_copy_(0, flat_GT, x_TH.unsqueeze(0).expand(G, -1, -1).reshape(-1, H))
        send_route.view(-1, 2 * K).index_copy_(0, flat_GT, route_GT2K.reshape(-1, 2 * K))
        send = torch.cat([_as_bytes(send_x[:, :C].reshape(G * C, H)), _as_bytes(send_route[:, :C].reshape(G * C, 2 * K))], dim=1)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        row_bytes = H * x_TH.element_size()
        rows_RH = recv[:, :row_bytes].contiguous().view(x_TH.dtype).view(G * C, H)
        route_R2K = recv[:, row_bytes:].contiguous().view(torch.float32).view(G * C, 2 * K)
        ids_RK, weights_RK = unpack_route(route_R2K, self.first_expert, e)
        return SlabRows(rows_RH, ids_RK, weights_RK, T, slot_GT=slot_GT, capacity=C)

    def combine(self, expert_out_RH: torch.Tensor, handle: Dispatched) -> torch.Tensor:
        """Send each slab's partial sums back and add every token's contributions (fp32): [T, H]."""
        assert isinstance(handle, SlabRows), type(handle)
        if handle.capacity == 0:  # the whole group had 0 rows
            return expert_out_RH
        G, C, H = self.group_size, handle.capacity, expert_out_RH.shape[1]
        back_RH = torch.empty_like(expert_out_RH)
        dist.all_to_all_single(back_RH, expert_out_RH.contiguous(), group=self.group)
        # Slab d's row slot_GT[d, t] is token t's partial sum from rank d; the dump row adds zero.
        back_GCH = torch.cat([back_RH.view(G, C, H).float(), back_RH.new_zeros(G, 1, H, dtype=torch.float32)], dim=1)
        picked_GTH = back_GCH.gather(1, handle.slot_GT.unsqueeze(-1).expand(-1, -1, H))
        return picked_GTH.sum(dim=0).to(expert_out_RH.dtype)

