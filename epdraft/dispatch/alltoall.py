"""`alltoall` layout, `torch` backend: each token goes only to the EP ranks owning its top-k experts.

A token is sent once per destination rank (with every pair that rank owns), not once per pair.
The per-destination row counts are exchanged first (one small all_to_all_single, a CPU sync on
NCCL), then rows and routes move with variable splits, which gloo and NCCL both take, empty
splits included. Experts apply the weights and sum each row's pairs; combine sends the partial
sums back and adds them at the owner.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from epdraft.dispatch.base import Dispatched
from epdraft.dispatch.plan import StepPlan
from epdraft.dispatch.rows import group_counts, pack_route, unpack_route
from epdraft.dispatch.layout import MoeLayout


@dataclasses.dataclass(frozen=True)
class ExchangedRows(Dispatched):
    """Rows received from the group, plus how to send their results back.

    token_S: [S] int64, the local token each sent row came from (sent rows ordered by destination).
    send_splits / recv_splits: rows sent to / received from each group rank.
    """

    token_S: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]


class AllToAllDispatcher:
    """all_to_all_single dispatch/combine over the EP group (whole experts per rank, moe_tp = 1)."""

    def __init__(self, layout: MoeLayout, group: dist.ProcessGroup):
        self.layout = layout
        self.group = group
        self.group_size = dist.get_world_size(group)
        self.first_expert = layout.first_expert

    @staticmethod
    def unsupported_reason(layout: MoeLayout, group: dist.ProcessGroup) -> str | None:
        if layout.tp_size > 1:
            return (
                f"draft.moe_layout = 'alltoall' sends tokens to whole experts; draft.moe_tp = {layout.tp_size} "
                "splits them (use moe_layout = 'gather' for moe_tp > 1)"
            )
        return None

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, plan: StepPlan | None
    ) -> ExchangedRows:
        """Send each token to the ranks owning its experts.

        Returns rows_RH [R, H] received here in x's dtype, ids_RK [R, K] local ids (-1 = a pair
        another rank owns), weights_RK [R, K] fp32.
        """
        T, H = x_TH.shape
        counts = group_counts(plan, self.group, T)
        e = self.layout.num_local_experts
        owner_TK = topk_ids_TK // e
        if sum(counts) == 0:  # the whole group agrees (same plan): no collective
            ids_RK, weights_RK = unpack_route(pack_route(topk_ids_TK, topk_weights_TK), self.first_expert, e)
            empty = torch.zeros(0, dtype=torch.int64, device=x_TH.device)
            return ExchangedRows(x_TH, ids_RK, weights_RK, T, token_S=empty, send_splits=[], recv_splits=[])
        ranks_G = torch.arange(self.group_size, device=x_TH.device)
        sends_GT = (owner_TK.unsqueeze(0) == ranks_G.view(-1, 1, 1)).any(dim=-1)
        dest_S, token_S = sends_GT.nonzero(as_tuple=True)  # row-major: grouped by destination
        send_counts_G = sends_GT.sum(dim=1)
        recv_counts_G = torch.empty_like(send_counts_G)
        dist.all_to_all_single(recv_counts_G, send_counts_G, group=self.group)
        send_splits, recv_splits = send_counts_G.tolist(), recv_counts_G.tolist()

        # Pairs owned by another destination than this row's stay global ids that the receiver maps to -1.
        ids_SK = topk_ids_TK[token_S]
        keep_SK = owner_TK[token_S] == dest_S.unsqueeze(1)
        route_S2K = pack_route(torch.where(keep_SK, ids_SK, -1), topk_weights_TK[token_S])
        rows_RH = x_TH.new_empty(sum(recv_splits), H)
        route_R2K = route_S2K.new_empty(sum(recv_splits), route_S2K.shape[1])
        dist.all_to_all_single(rows_RH, x_TH[token_S], recv_splits, send_splits, group=self.group)
        dist.all_to_all_single(route_R2K, route_S2K, recv_splits, send_splits, group=self.group)
        ids_RK, weights_RK = unpack_route(route_R2K, self.first_expert, e)
        return ExchangedRows(rows_RH, ids_RK, weights_RK, T, token_S=token_S, send_splits=send_splits, recv_splits=recv_splits)

    def combine(self, expert_out_RH: torch.Tensor, handle: Dispatched) -> torch.Tensor:
        """Send partial sums back and add each token's contributions (fp32) at its owner: [T, H]."""
        assert isinstance(handle, ExchangedRows), type(handle)
        if not handle.send_splits:  # the whole group had 0 rows
            return expert_out_RH
        back_SH = expert_out_RH.new_empty(len(handle.token_S), expert_out_RH.shape[1])
        dist.all_to_all_single(back_SH, expert_out_RH, handle.send_splits, handle.recv_splits, group=self.group)
        out_TH = torch.zeros(handle.num_tokens, back_SH.shape[1], dtype=torch.float32, device=back_SH.device)
        out_TH.index_add_(0, handle.token_S, back_SH.float())
        return out_TH.to(expert_out_RH.dtype)

    def close(self) -> None:
        """Nothing to free: buffers are per call."""
