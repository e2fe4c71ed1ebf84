"""The fixed-size dispatch paths captured in a CUDA graph, on one GPU with a 1-rank NCCL group.

Each capturable torch layout (`alltoall` with `torch_fixed`, `gather` with `max_len` and
`sum_len`) runs a DraftMoE whose forward is captured over a static input buffer and replayed on
fresh rows copied into it; the same layer also runs eagerly. Replay and eager are compared with the
single-process DraftMoE (ReplicatedDispatcher, same weights) run eagerly, within DESIGN.md's bf16
drift (max |dy| <= 0.2 mean|y|, mean |dy| <= 0.02 mean|y|), and both run under
`torch.cuda.set_sync_debug_mode("error")`: no host synchronization. T = 0 (the all-idle plan of a
group of one) runs eagerly only (see `capture_world._idle_vs_reference`). DeepEP's low-latency
kernels (issue 34; skipped where `deep_ep` does not import: tools/build_deepep.sh builds it) run
the same check, dispatching to the rank itself.

The rank runs in a spawned process (tests.harness), so its NCCL world never meets the process
groups of other tests in the same pytest process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dispatch.capture_world import run_captured_cases
from tests.dispatch.moe_world import ROUTERS, WorldOptions
from tests.harness import run_ranks

MAX_DY, MEAN_DY = 0.2, 0.02  # DESIGN.md, relative to mean |y|
ROWS = (1, 16, 100, 0)  # 0: the idle rank, eager only
REPLAYS = 5
OPTIONS = WorldOptions(device="cuda", dtype=torch.bfloat16, hidden=256, intermediate=64)
LAYOUTS = [("alltoall", "torch_fixed", "max_len"), ("gather", "torch", "max_len"), ("gather", "torch", "sum_len")]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(),
                       reason="needs a CUDA GPU and a torch build with NCCL"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS, ids=["-".join(c) for c in LAYOUTS])
def test_captured_dispatch_equals_reference_without_host_sync(layout):
    cases = [(*layout, router) for router in ROUTERS]
    (report,) = run_ranks(1, run_captured_cases, cases, ROWS, REPLAYS, OPTIONS, timeout_s=280, pg_timeout_s=120,
                          backend="nccl")  # fmt: skip
    assert sorted(report) == sorted((case, T) for case in cases for T in ROWS)
    for (case, T), r in report.items():
        assert r["capturable"], (case, T)
        if T == 0:
            assert r["shape"] == r["ref_shape"] == (0, OPTIONS.hidden) and r["dtype"] == r["ref_dtype"], (case, r)
            continue
        assert r["replays"] == REPLAYS, (case, T, r)
        for kind in ("replay", "eager"):
            assert r[f"{kind}_max_dy"] <= MAX_DY and r[f"{kind}_mean_dy"] <= MEAN_DY, (case, T, kind, r)


@pytest.mark.timeout(300)
def test_deepep_low_latency_captured_equals_reference_without_host_sync():
    pytest.importorskip("deep_ep", reason="DeepEP is not importable here (tools/build_deepep.sh)")
    options = WorldOptions(device="cuda", dtype=torch.bfloat16, hidden=2048, intermediate=64, low_latency=True)
    cases = [("alltoall", "deepep", "max_len", router) for router in ROUTERS]
    rows = (1, 16, 100)
    (report,) = run_ranks(1, run_captured_cases, cases, rows, REPLAYS, options, timeout_s=280, pg_timeout_s=120,
                          backend="nccl")  # fmt: skip
    assert sorted(report) == sorted((case, T) for case in cases for T in rows)
    for (case, T), r in report.items():
        assert r["capturable"] and r["replays"] == REPLAYS, (case, T, r)
        for kind in ("replay", "eager"):
            assert r[f"{kind}_max_dy"] <= MAX_DY and r[f"{kind}_mean_dy"] <= MEAN_DY, (case, T, kind, r)
