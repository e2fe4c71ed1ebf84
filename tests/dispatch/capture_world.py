"""Rank-side code of tests/gpu/test_capture_dispatch.py: fixed-size dispatch captured in a CUDA graph.

Runs on a 1-rank NCCL world (the spawner sets cuda:0 and inits the default group): each case builds
the fixed-size dispatcher over that group, the DraftMoE holding this rank's shard (all experts, a
group of one), and the single-process reference DraftMoE with the same weights; it captures the
layer's forward over a static input buffer, replays it on fresh rows copied into that buffer, and
runs the same layer eagerly, both under `torch.cuda.set_sync_debug_mode("error")`, comparing both
with the reference run eagerly. Module-level (not in the test file) so the spawned rank can
import it by name, as `moe_world.run_cases` is for the NCCL dispatch tests.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from epdraft.dispatch import MoeLayout, StepPlan, make_dispatcher
from epdraft.layers.moe import DraftMoE
from tests.dispatch.moe_world import WorldOptions, moe_spec, reference_moe, sharded_moe


@contextlib.contextmanager
def no_host_sync():
    """Any synchronizing CUDA call inside raises (torch's sync debug mode), restored on the way out."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def drift(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |dy|, mean |dy|), each relative to mean |ref|: DESIGN.md's bf16 drift metric."""
    dy, scale = (y.float() - ref.float()).abs(), ref.float().abs().mean().clamp_min(1e-12)
    return (dy.max() / scale).item(), (dy.mean() / scale).item()


def _captured_vs_reference(
    moe: DraftMoE, full: DraftMoE, rows: int, replays: int, gen: torch.Generator, options: WorldOptions
) -> dict:
    """Capture `moe` over a static [rows, H] buffer, then replay and run eagerly on fresh rows."""
    plan = StepPlan(step=0, ranks=(dist.get_rank(),), counts=(rows,))
    x_TH = torch.randn(rows, options.hidden, generator=gen, device="cuda").to(options.dtype)
    # Warm up on a side stream (Triton compilation, lazy buffers, the NCCL communicator), as
    # StepGraphs does, so the capture records only the step's kernels and collectives.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe(x_TH, plan)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_TH = moe(x_TH, plan)
    r = {"replay_max_dy": 0.0, "replay_mean_dy": 0.0, "eager_max_dy": 0.0, "eager_mean_dy": 0.0, "replays": 0}
    for _ in range(replays):
        fresh_TH = torch.randn(rows, options.hidden, generator=gen, device="cuda").to(options.dtype)
        with no_host_sync():
            x_TH.copy_(fresh_TH)
            graph.replay()
            eager_TH = moe(fresh_TH, plan)
        ref_TH = full(fresh_TH)
        for kind, got in (("replay", y_TH), ("eager", eager_TH)):
            max_dy, mean_dy = drift(got, ref_TH)
            r[f"{kind}_max_dy"] = max(r[f"{kind}_max_dy"], max_dy)
            r[f"{kind}_mean_dy"] = max(r[f"{kind}_mean_dy"], mean_dy)
        r["replays"] += 1
    torch.cuda.synchronize()
    return r


def _idle_vs_reference(moe: DraftMoE, full: DraftMoE, options: WorldOptions) -> dict:
    """T = 0 under a plan of zero rows (a group of one idle rank: the all-idle plan), run eagerly.

    No graph: dispatch skips its collectives when the whole group has no rows, so a capture would
    hold no communication, and the runtime skips such a step anyway (`StepPlan.skip`).
    """
    plan = StepPlan(step=0, ranks=(dist.get_rank(),), counts=(0,))
    x_TH = torch.empty(0, options.hidden, device="cuda", dtype=options.dtype)
    with no_host_sync():
        y_TH = moe(x_TH, plan)
    ref_TH = full(x_TH)
    return {"shape": tuple(y_TH.shape), "dtype": str(y_TH.dtype), "ref_shape": tuple(ref_TH.shape),
            "ref_dtype": str(ref_TH.dtype)}  # fmt: skip


def run_captured_cases(
    rank: int, world: int, cases: list[tuple], rows: tuple[int, ...], replays: int, options: WorldOptions
) -> dict:
    """Run every (layout, backend, dp_padding, router) case at every row count in `rows` (0 = idle).

    Returns, per (case, rows): the worst replay and eager drift against the reference over
    `replays` fresh inputs, and the layout's `capturable`; for rows = 0, the output's and the
    reference's shape and dtype.
    """
    group = dist.group.WORLD
    report: dict = {}
    for case_idx, case in enumerate(cases):
        layout_name, backend, padding, router = case
        spec = moe_spec(router, options.intermediate)
        layout = MoeLayout(
            layout=layout_name, backend=backend, dp_padding=padding, max_rows_per_rank=max(rows),
            num_experts=spec.num_experts, hidden_size=options.hidden, top_k=spec.top_k, device_type="cuda",
            low_latency=options.low_latency,
        )  # fmt: skip
        dispatcher = make_dispatcher(layout, group)
        full = reference_moe(spec, 300 + case_idx, options)
        moe = sharded_moe(full, dispatcher, options)
        gen = torch.Generator(device="cuda").manual_seed(case_idx)
        with torch.no_grad():
            for T in rows:
                if T == 0:
                    report[case, T] = _idle_vs_reference(moe, full, options)
                else:
                    report[case, T] = _captured_vs_reference(moe, full, T, replays, gen, options)
                report[case, T]["capturable"] = layout.capturable
        dispatcher.close()
    return report
