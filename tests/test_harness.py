import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks


def _sum_ranks(rank, world):
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return int(t)


def _fail_on_one(rank, world):
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def _hang_on_one(rank, world):
    dist.barrier()  # both ranks are up: the deadline below measures the hang, not process start-up
    if rank == 0:
        import time

        time.sleep(120)
    return rank


@pytest.mark.timeout(60)
def test_run_ranks_returns_each_ranks_result():
    assert run_ranks(3, _sum_ranks) == [6, 6, 6]


@pytest.mark.timeout(60)
def test_run_ranks_names_the_failing_rank():
    with pytest.raises(AssertionError, match=r"rank 1:[\s\S]*boom on purpose"):
        run_ranks(2, _fail_on_one)


@pytest.mark.timeout(60)
def test_run_ranks_kills_a_hung_rank():
    with pytest.raises(AssertionError, match=r"ranks \[0\] did not finish"):
        run_ranks(2, _hang_on_one, timeout_s=25)
