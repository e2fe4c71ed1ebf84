"""The step coordinator: one small exchange per step, so every rank learns every rank's row count
before any MoE layer runs.

The plan it returns is the only thing a rank may branch a collective on (skip the step, pad
length, buffer sizes): branching on the local row count instead is a hang, because a rank that
skips a collective leaves its peers waiting in it. The step id travels in the same exchange, so
ranks that fell out of lockstep fail together with `StepMismatch` instead of pairing the wrong
collectives.

Where it runs: on GPUs, one NCCL all-gather of the int64s on the device group (no TCP round, no
gloo thread); on CPU ranks, shared memory among the ranks of each host and the rendezvous store
among hosts (`HostExchange`; the store alone, `StoreExchange`, where shared memory is not used),
since gloo's all-gather is a ring of 2(W-1) dependent rounds.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from epdraft.dispatch.plan import StepPlan
from epdraft.errors import ParallelError, StepMismatch
from epdraft.parallel.exchange import DeviceExchange, HostExchange, StoreExchange, shared_memory_ok
from epdraft.parallel.groups import Groups

log = logging.getLogger(__name__)


def counts_digest(counts: Sequence[int]) -> int:
    """A 56-bit digest of a row-count list (any ints), the same on every host (Python's hash is
    not guaranteed to be): what a rank sends for "the counts my engine passed"."""
    packed = ",".join(str(int(c)) for c in counts).encode()
    return int.from_bytes(hashlib.blake2b(packed, digest_size=7).digest(), "little")


NO_DIGEST = -1  # a rank that checks no engine counts this step


class StepCoordinator:
    """Gathers `[step, rows, counts digest, *extras]` from every rank of `group` in one exchange.

    Args:
        group: the ranks that must agree (for the draft: every rank whose MoE groups it feeds).
        num_extras: how many extra ints each caller adds per step (the same on every rank, so
            every rank's contribution has the same size).
        device: "cpu": the values go through shared memory and the rendezvous store among `group`'s
            ranks (`group` only names them); a CUDA device: one all-gather on `group`, an NCCL group.
    """

    def __init__(self, group: dist.ProcessGroup, *, num_extras: int = 0, device: torch.device | str = "cpu"):
        if num_extras < 0:
            raise ParallelError(f"StepCoordinator: num_extras = {num_extras} must be >= 0")
        self.group = group
        self.num_extras = num_extras
        self.device = torch.device(device)
        self.ranks = tuple(dist.get_process_group_ranks(group))
        self.rank = dist.get_rank()
        width = 3 + num_extras
        if self.device.type != "cpu":
            self._exchange = DeviceExchange(group, device=self.device, width=width)
        elif shared_memory_ok():
            self._exchange = HostExchange.over(group, width=width)
        else:
            self._exchange = StoreExchange.over(group, width=width)

    @classmethod
    def for_groups(cls, groups: Groups, *, num_extras: int = 0) -> StepCoordinator:
        """The draft's coordinator: on the device group (attn_dp, NCCL) where the ranks have GPUs,
        among the cpu group's ranks (shared memory, the store between hosts) on CPU."""
        if groups.device_type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
            return cls(groups.attn_dp, num_extras=num_extras, device=device)
        return cls(groups.cpu, num_extras=num_extras)

    def sync(
        self, step: int, local_rows: int, extras: tuple[int, ...] = (), expected: Sequence[int] | None = None
    ) -> StepPlan:
        """Agree on this step's row counts; every rank of the group must call it once per step.

        `expected`: the counts this rank's engine says the group agreed on (group order). Its digest
        travels in the same exchange, so a disagreement is seen by every rank at once, even when
        only one engine got it wrong (each rank comparing its own list would leave the others
        stepping into a collective the wrong one never joins).

        Returns:
            StepPlan with every rank's count (and extras) in group order.
        Raises:
            StepMismatch: on every rank, when the ranks passed different step ids (names each
                rank and its step id), or when a rank's `expected` differs from the gathered counts
                (names those ranks; on each of them, the list its engine passed).
            ParallelError: local_rows < 0 or len(extras) != num_extras on this rank (a caller bug;
                raised before the exchange, so the other ranks fail at the store's or the group's
                timeout, or are told by the watchdog).
        """
        if local_rows < 0:
            raise ParallelError(f"rank {self.rank}: step {step} local_rows = {local_rows} must be >= 0")
        if len(extras) != self.num_extras:
            raise ParallelError(
                f"rank {self.rank}: step {step} passed {len(extras)} extras, StepCoordinator expects {self.num_extras}"
            )
        digest = NO_DIGEST if expected is None else counts_digest(expected)
        rows = self._exchange.all_gather([step, local_rows, digest, *extras])
        steps = [r[0] for r in rows]
        if any(s != step for s in steps):
            by_rank = ", ".join(f"rank {rank}: {s}" for rank, s in zip(self.ranks, steps))
            raise StepMismatch(f"ranks disagree on the step id at rank {self.rank}'s step {step} ({by_rank})")
        plan = StepPlan(
            step=step,
            ranks=self.ranks,
            counts=tuple(r[1] for r in rows),
            extras=tuple(r[3:] for r in rows) if self.num_extras else (),
        )
        gathered = counts_digest(plan.counts)
        wrong = [rank for rank, r in zip(self.ranks, rows) if r[2] not in (NO_DIGEST, gathered)]
        if wrong:
            mine = f"; this rank's engine passed {list(expected)}" if self.rank in wrong else ""
            raise StepMismatch(
                f"rank {self.rank}, step {step}: the engine's counts on ranks {wrong} differ from the gathered "
                f"{list(plan.counts)} (ranks {list(self.ranks)}){mine}"
            )
        if plan.skip:
            log.debug("step %d: every rank has 0 rows, skipping", step)
        return plan
