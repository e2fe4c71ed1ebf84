import pytest
import torch
import torch.distributed as dist

from epdraft.errors import ParallelError
from epdraft.parallel.spawn import run_local_ranks
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


def test_nccl_refused_with_fewer_gpus_than_ranks():
    world = torch.cuda.device_count() + 1
    with pytest.raises(ParallelError, match=rf"{world} NCCL ranks need {world} GPUs \(one each\), torch sees {world - 1}"):
        run_local_ranks(world, _sum_ranks, backend="nccl")


def test_unknown_backend_refused():
    with pytest.raises(ParallelError, match=r"backend = 'mpi', expected one of gloo, nccl"):
        run_local_ranks(2, _sum_ranks, backend="mpi")
