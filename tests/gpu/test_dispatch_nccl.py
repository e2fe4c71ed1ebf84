"""The dispatch equivalence cases of tests/dispatch on NCCL GPU ranks in bf16: every layout and backend.

One spawned NCCL world (rank r on cuda:r) per test runs `tests.dispatch.moe_world.run_cases`, the
same world function as the gloo tests: StepSync on a gloo CPU group, the MoE groups on NCCL, 50
steps of random per-rank row counts with zero-row ranks and all-zero steps, every rank's output
against the single-process DraftMoE on the same bf16 rows. Tolerance: DESIGN.md's bf16 drift,
max |dy| <= 0.2 mean|y| and mean |dy| <= 0.02 mean|y| on every step. Worlds: 2, 4 and
min(GPUs, 8), as many as the machine has. DeepEP and Mooncake EP cases skip, quoting their
backend's unsupported reason, when their package is not installed.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from epdraft.dispatch.deepep import DeepEPDispatcher
from epdraft.dispatch.mooncake import MooncakeDispatcher
from epdraft.dispatch.layout import MoeLayout
from tests.dispatch.moe_world import ROUTERS, WorldOptions, all_splits, alltoall_cases, gather_cases, run_cases
from tests.harness import run_ranks

GPUS = torch.cuda.device_count()
WORLDS = sorted({w for w in (2, 4, min(GPUS, 8)) if 2 <= w <= GPUS}) or [2]
STEPS = 50
MAX_DY, MEAN_DY = 0.2, 0.02  # DESIGN.md, relative to mean |y|

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2, reason=f"needs >= 2 CUDA GPUs (one per NCCL rank), torch sees {GPUS}"),
]

# H = 256: Mooncake EP needs H % 128 == 0, DeepEP normal H % 8; I = 64 splits over moe_tp up to 8.
BF16 = WorldOptions(device="cuda", dtype=torch.bfloat16, hidden=256, intermediate=64, max_rows_per_rank=16)
# DeepEP's low-latency kernels are built for a fixed list of hidden sizes, the smallest 2048.
BF16_LOW_LATENCY = WorldOptions(
    device="cuda", dtype=torch.bfloat16, hidden=2048, intermediate=64, max_rows_per_rank=16, low_latency=True
)


def _missing_package_reason(cls: type, module: str) -> str | None:
    """The backend's own unsupported reason when `module` is not installed, else None.

    The package check is the first thing `unsupported_reason` does, before it looks at the group,
    so no process group is needed to ask it.
    """
    package = module.split(".")[0]
    if importlib.util.find_spec(package) is not None and importlib.util.find_spec(module) is not None:
        return None
    layout = MoeLayout(layout="alltoall", num_experts=8, hidden_size=BF16.hidden, top_k=2, ep_size=2)
    return cls.unsupported_reason(layout, None)


def _check(reports: list[dict], cases: list[tuple]) -> None:
    for rank, report in enumerate(reports):
        assert list(report) == cases, rank
        for case, r in report.items():
            assert r["compared"] > 0 and r["skipped"] > 0 and r["idle"] > 0, (rank, case, r)
            assert r["max_dy"] <= MAX_DY and r["mean_dy"] <= MEAN_DY, (rank, case, r)


def _run(world: int, cases: list[tuple], options: WorldOptions, timeout_s: float) -> None:
    if not cases:
        pytest.skip(f"no (moe_ep, moe_tp) split of the 8 experts tiles {world} ranks for this backend")
    reports = run_ranks(world, run_cases, cases, STEPS, options, timeout_s=timeout_s, pg_timeout_s=120, backend="nccl")
    _check(reports, cases)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("world", WORLDS)
def test_torch_layouts_equal_reference_on_nccl(world):
    cases = (
        [("replicated", "torch", "max_len", 1, 1, router) for router in ROUTERS]
        + gather_cases(world, all_splits(world, intermediate=BF16.intermediate))
        + alltoall_cases(world)
        + alltoall_cases(world, "torch_fixed")
    )
    _run(world, cases, BF16, timeout_s=460)


# EP backends: (its dispatcher class, the module it needs, its cases for a world, the row shapes).
EP_BACKENDS = {
    "deepep": (DeepEPDispatcher, "deep_ep", lambda world: alltoall_cases(world, "deepep"), BF16),
    # One EP group spanning the world: low-latency buffers are NVSHMEM-backed, one world-wide group each.
    "deepep_ll": (DeepEPDispatcher, "deep_ep", lambda world: alltoall_cases(world, "deepep", eps=(world,)),
                  BF16_LOW_LATENCY),
    "mooncake": (MooncakeDispatcher, "mooncake.mooncake_ep_buffer", lambda world: alltoall_cases(world, "mooncake"),
                 BF16),
}  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("backend", list(EP_BACKENDS))
def test_ep_backend_equals_reference_on_nccl(backend, world):
    cls, module, cases, options = EP_BACKENDS[backend]
    reason = _missing_package_reason(cls, module)
    if reason is not None:
        pytest.skip(reason)
    _run(world, cases(world), options, timeout_s=280)
