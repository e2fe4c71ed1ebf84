"""The step coordinator: one small collective per step, so every rank learns every rank's row count
before any MoE layer runs.

The plan it returns is the only thing a rank may branch a collective on (skip the step, pad
length, buffer sizes): branching on the local row count instead is a hang, because a rank that
skips a collective leaves its peers waiting in it. The step id travels in the same
gather, so ranks that fell out of lockstep fail together with `StepMismatch` instead of pairing the
wrong collectives.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from epdraft.dispatch.plan import StepPlan
from epdraft.errors import ParallelError, StepMismatch

log = logging.getLogger(__name__)

# torch >= 2.13 renames all_gather_into_tensor (same semantics); older releases only have the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class StepCoordinator:
    """Gathers `[step, rows, *extras]` from every rank of `group` in one all-gather.

    Args:
        group: the ranks that must agree (for the draft: every rank whose MoE groups it feeds;
            a gloo CPU group keeps the sync off the GPU stream).
        num_extras: how many extra ints each caller adds per step (the same on every rank, so
            every rank's contribution has the same size).
        device: where the gathered int64 tensor lives: "cpu" for gloo, the rank's GPU for NCCL.
    """

    def __init__(self, group: dist.ProcessGroup, *, num_extras: int = 0, device: torch.device | str = "cpu"):
        if num_extras < 0:
            raise ParallelError(f"StepCoordinator: num_extras = {num_extras} must be >= 0")
        self.group = group
        self.num_extras = num_extras
        self.device = torch.device(device)
        self.ranks = tuple(dist.get_process_group_ranks(group))
        self.rank = dist.get_rank()

    def sync(self, step: int, local_rows: int, extras: tuple[int, ...] = ()) -> StepPlan:
        """Agree on this step's row counts; every rank of the group must call it once per step.

        Returns:
            StepPlan with every rank's count (and extras) in group order.
        Raises:
            StepMismatch: on every rank, when the ranks passed different step ids (names each
                rank and its step id).
            ParallelError: local_rows < 0 or len(extras) != num_extras on this rank (a caller bug;
                raised before the collective, so the other ranks fail at the group's timeout).
        """
        if local_rows < 0:
            raise ParallelError(f"rank {self.rank}: step {step} local_rows = {local_rows} must be >= 0")
        if len(extras) != self.num_extras:
            raise ParallelError(
                f"rank {self.rank}: step {step} passed {len(extras)} extras, StepCoordinator expects {self.num_extras}"
            )
        width = 2 + self.num_extras
        mine = torch.tensor([step, local_rows, *extras], dtype=torch.int64, device=self.device)
        gathered = torch.empty(len(self.ranks) * width, dtype=torch.int64, device=self.device)
        _all_gather_single(gathered, mine, group=self.group)
        rows = [tuple(r) for r in gathered.view(len(self.ranks), width).tolist()]
        steps = [r[0] for r in rows]
        if any(s != step for s in steps):
            by_rank = ", ".join(f"rank {rank}: {s}" for rank, s in zip(self.ranks, steps))
            raise StepMismatch(f"ranks disagree on the step id at rank {self.rank}'s step {step} ({by_rank})")
        plan = StepPlan(
            step=step,
            ranks=self.ranks,
            counts=tuple(r[1] for r in rows),
            extras=tuple(r[2:] for r in rows) if self.num_extras else (),
        )
        if plan.skip:
            log.debug("step %d: every rank has 0 rows, skipping", step)
        return plan
