"""StepCoordinator: one all-gather per step gives every rank the same StepPlan; out-of-step ranks fail together."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from epdraft.errors import ParallelError, StepMismatch
from epdraft.runtime.coordinator import StepCoordinator
from tests.harness import run_ranks


def _sync_checks(rank: int, world: int) -> dict:
    sync = StepCoordinator(dist.group.WORLD, num_extras=2)
    out = {}
    plan = sync.sync(7, [3, 0, 5][rank], extras=(rank, 10 * rank))
    out["plan"] = (plan.step, plan.ranks, plan.counts, plan.total, plan.max_count, plan.skip, plan.extras)

    out["zero"] = sync.sync(8, 0, extras=(0, 0)).skip  # every rank skips together ...
    out["after_zero"] = sync.sync(9, 1, extras=(0, 0)).counts  # ... and the next step still pairs up

    try:
        sync.sync(11 if rank == 1 else 10, 2, extras=(0, 0))
        out["mismatch"] = None
    except StepMismatch as e:
        out["mismatch"] = str(e)

    # Only rank 0's engine passed counts, wrong about rank 2: every rank raises, naming rank 0.
    try:
        sync.sync(13, 1, extras=(0, 0), expected=[1, 1, 2] if rank == 0 else None)
        out["engine"] = None
    except StepMismatch as e:
        out["engine"] = str(e)
    out["after_engine"] = sync.sync(14, 1, extras=(0, 0), expected=[1, 1, 1]).counts  # right: no error

    try:
        sync.sync(12, -1, extras=(0, 0))  # every rank passes the bad count: each raises before the collective
    except ParallelError as e:
        out["negative"] = str(e)
    try:
        sync.sync(12, 1, extras=(0,))
    except ParallelError as e:
        out["extras"] = str(e)
    return out


@pytest.mark.timeout(60)
def test_step_sync_plans_mismatch_and_bad_input():
    results = run_ranks(3, _sync_checks, timeout_s=50)
    for rank, out in enumerate(results):
        assert out["plan"] == (7, (0, 1, 2), (3, 0, 5), 8, 5, False, ((0, 0), (1, 10), (2, 20)))
        assert out["zero"] is True
        assert out["after_zero"] == (1, 1, 1)
        assert out["mismatch"] is not None, f"rank {rank} did not raise StepMismatch"
        assert "rank 0: 10, rank 1: 11, rank 2: 10" in out["mismatch"]
        assert f"rank {rank}'s step" in out["mismatch"]
        assert out["engine"] == (f"rank {rank}, step 13: the engine's counts on ranks [0] differ from the gathered "
                                 "[1, 1, 1] (ranks [0, 1, 2])" + ("; this rank's engine passed [1, 1, 2]"
                                                                  if rank == 0 else ""))  # fmt: skip
        assert out["after_engine"] == (1, 1, 1)
        assert out["negative"] == f"rank {rank}: step 12 local_rows = -1 must be >= 0"
        assert out["extras"] == f"rank {rank}: step 12 passed 1 extras, StepCoordinator expects 2"
