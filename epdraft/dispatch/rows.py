"""Helpers the torch backends share: reading the plan for one group, packing routes next to rows."""

from __future__ import annotations

import torch
import torch.distributed as dist

from epdraft.dispatch.plan import StepPlan
from epdraft.errors import ParallelError


def group_counts(plan: StepPlan | None, group: dist.ProcessGroup, num_tokens: int) -> tuple[int, ...]:
    """Row counts of `group`'s members (group order), checked against this rank's own T.

    Raises ParallelError when there is no plan or it disagrees with x: the buffers every rank sizes
    from the plan would not match, which corrupts rows or hangs.
    """
    rank = dist.get_rank()
    if plan is None:
        raise ParallelError(f"rank {rank}: dispatch needs the step's StepPlan (from StepCoordinator.sync), got None")
    counts = plan.counts_of(dist.get_process_group_ranks(group))
    mine = counts[dist.get_rank(group)]
    if mine != num_tokens:
        raise ParallelError(f"rank {rank}: step {plan.step} plan says {mine} rows, dispatch got x with {num_tokens}")
    return counts


def pack_route(ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """[T, 2K] fp32: expert ids as floats, then weights, so one collective moves both.

    Ids are exact as fp32 (integers below 2**24), and adding the zero-filled slots of other ranks
    (sum_len's all-reduce) leaves them unchanged.
    """
    return torch.cat([ids_TK.float(), weights_TK.float()], dim=1)


def unpack_route(route_R2K: torch.Tensor, first_expert: int, num_local_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(local ids [R, K] int64, weights [R, K] fp32) from `pack_route` rows.

    Global id -> id - first_expert when this rank holds it, else -1 (another rank's expert, or a
    padded row, which carries -1).
    """
    k = route_R2K.shape[1] // 2
    local_RK = route_R2K[:, :k].long() - first_expert
    held_RK = (local_RK >= 0) & (local_RK < num_local_experts)
    return torch.where(held_RK, local_RK, -1), route_R2K[:, k:]
