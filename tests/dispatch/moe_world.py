"""Shared rank-side code of the dispatch equivalence tests: one spawned world runs many cases.

Each case builds a single-process DraftMoE holding every expert (the reference) and this rank's
sharded DraftMoE (its e = E/ep experts and F = I/tp slice, weights sliced from the reference),
then runs many steps of random per-rank row counts through StepCoordinator -> DraftMoE and compares
every rank's output with the reference on the same rows.

The same code runs on gloo CPU ranks in fp32 (tests/dispatch) and on NCCL GPU ranks in bf16
(tests/gpu/test_dispatch_nccl.py): `WorldOptions` says which; each test applies its own tolerance
to the errors reported (fp32: worst relative to max|y|; bf16: max and mean |dy| relative to mean|y|).
StepCoordinator always runs on a gloo group, as in the worker (the `cpu` group of `Groups`).
"""

from __future__ import annotations

import dataclasses
import random

import torch
import torch.distributed as dist

from epdraft.config.ffn import DraftMoeFFNSpec, RouterSpec
from epdraft.dispatch import MoeLayout, make_dispatcher
from epdraft.layers.moe import DraftMoE
from epdraft.runtime.coordinator import StepCoordinator

HIDDEN = 16
INTERMEDIATE = 8
GATHER_SPLITS = [(2, 1), (4, 1), (2, 2), (1, 2)]
ROUTERS = {
    "softmax": RouterSpec(num_experts=8, top_k=2, scoring="softmax"),
    "sigmoid_grouped_bias": RouterSpec(
        num_experts=8,
        top_k=3,
        scoring="sigmoid",
        n_group=4,
        topk_group=2,
        bias="selection",
        routed_scaling_factor=2.5,
        renorm_eps=1e-20,
    ),
}


@dataclasses.dataclass(frozen=True)
class WorldOptions:
    """Where and how a world runs its cases (picklable: it travels to the spawned ranks).

    device: "cpu", or "cuda" (the rank's current GPU, set by the spawner). dtype: of the weights and
    rows (the router stays fp32). hidden / intermediate: H and I of every case's MoE (DeepEP
    low-latency needs H in its kernel list, Mooncake H % 128 == 0). max_rows_per_rank,
    low_latency: passed to make_dispatcher for the fixed-buffer backends.
    """

    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    hidden: int = HIDDEN
    intermediate: int = INTERMEDIATE
    max_rows_per_rank: int = 0
    low_latency: bool = False


CPU_FP32 = WorldOptions()


def all_splits(world: int, num_experts: int = 8, intermediate: int = INTERMEDIATE) -> list[tuple[int, int]]:
    """Every (ep, tp) with a MoE group of >= 2 ranks tiling `world`, ep | experts and tp | intermediate."""
    return [
        (ep, tp)
        for ep in range(1, num_experts + 1)
        for tp in range(1, world + 1)
        if ep * tp >= 2 and world % (ep * tp) == 0 and num_experts % ep == 0 and intermediate % tp == 0
    ]


def gather_cases(world: int, splits: list[tuple[int, int]] = GATHER_SPLITS) -> list[tuple]:
    """gather cases: both paddings and both routers for every split that tiles `world`."""
    return [
        ("gather", "torch", padding, ep, tp, router)
        for ep, tp in splits
        if world % (ep * tp) == 0
        for padding in ("max_len", "sum_len")
        for router in ROUTERS
    ]


def alltoall_cases(world: int, backend: str = "torch", eps: tuple[int, ...] = (2, 4, 8)) -> list[tuple]:
    """alltoall cases (moe_tp = 1): every EP size in `eps` that tiles `world` and divides the experts, both routers."""
    return [
        ("alltoall", backend, "max_len", ep, 1, router)
        for ep in eps
        if world % ep == 0
        for router, spec in ROUTERS.items()
        if spec.num_experts % ep == 0
    ]


def moe_spec(router: str, intermediate: int = INTERMEDIATE) -> DraftMoeFFNSpec:
    return DraftMoeFFNSpec(router=ROUTERS[router], intermediate_size=intermediate, shared_intermediate_size=12)


def reference_moe(spec: DraftMoeFFNSpec, seed: int, options: WorldOptions = CPU_FP32) -> DraftMoE:
    """The single-process DraftMoE with all experts, random weights (same on every rank).

    Weights are drawn in fp32 on the CPU and copied (cast) to the options' device and dtype, so
    every rank and every dtype starts from the same numbers.
    """
    moe = DraftMoE(spec, options.hidden, dtype=options.dtype, device=options.device)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return moe


def sharded_moe(full: DraftMoE, dispatcher, options: WorldOptions = CPU_FP32) -> DraftMoE:
    """This rank's DraftMoE, placed by `dispatcher.layout`: experts [ep_rank*e, (ep_rank+1)*e),
    intermediate rows [tp_rank*F, (tp_rank+1)*F)."""
    spec, layout = full.spec, dispatcher.layout
    moe = DraftMoE(spec, options.hidden, dispatcher=dispatcher, dtype=options.dtype, device=options.device)
    e = spec.num_experts // layout.ep_size
    F_ = spec.intermediate_size // layout.tp_size
    experts = slice(layout.ep_rank * e, (layout.ep_rank + 1) * e)
    f = slice(layout.tp_rank * F_, (layout.tp_rank + 1) * F_)
    w13 = full.experts.w13[experts]
    gate, up = w13[:, : spec.intermediate_size], w13[:, spec.intermediate_size :]
    sliced = {
        "experts.w13": torch.cat([gate[:, f], up[:, f]], dim=1),
        "experts.w2": full.experts.w2[experts][:, :, f],
    }
    with torch.no_grad():
        full_params = dict(full.named_parameters())
        for name, p in moe.named_parameters():
            p.copy_(sliced.get(name, full_params[name]))
    return moe


def moe_group(rank: int, world: int, ep: int, tp: int) -> dist.ProcessGroup:
    """This rank's MoE group: blocks of ep*tp consecutive ranks (global rank = (dp*ep + ep_rank)*tp + tp_rank).

    Every rank creates every group, in the same order (new_group is collective).
    """
    size = ep * tp
    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return mine


def step_counts(rng: random.Random, world: int, step: int) -> list[int]:
    """Per-rank row counts: random incl. 0, one rank with every row (all but one at 0), all at 0."""
    kind = step % 5
    if kind in (0, 1):
        return [rng.randint(0, 6) for _ in range(world)]
    if kind == 2:
        counts = [0] * world
        counts[rng.randrange(world)] = rng.randint(1, 9)
        return counts
    if kind == 3:
        return [rng.choice([0, 0, 1, 7]) for _ in range(world)]
    return [0] * world if step % 10 == 4 else [rng.randint(1, 4) for _ in range(world)]


def cpu_group() -> dist.ProcessGroup:
    """A gloo group over the whole world for StepCoordinator (the world itself when it is gloo already)."""
    if dist.get_backend() == dist.Backend.GLOO:
        return dist.group.WORLD
    return dist.new_group(list(range(dist.get_world_size())), backend="gloo")


def run_cases(rank: int, world: int, cases: list[tuple], num_steps: int, options: WorldOptions = CPU_FP32) -> dict:
    """Run every (layout, backend, dp_padding, ep, tp, router) case for num_steps steps.

    Returns, per case: counts of compared steps, skipped (all-zero) steps and idle steps (this rank
    had 0 rows while others had rows); `worst`, the largest max|dy| / max|y| of a step; `max_dy` and
    `mean_dy`, the largest max|dy| / mean|y| and mean|dy| / mean|y| of a step (DESIGN.md's bf16 metric).
    """
    sync = StepCoordinator(cpu_group())
    groups: dict[tuple[int, int], dist.ProcessGroup] = {}
    step_id = 0
    report = {}
    for case_idx, case in enumerate(cases):
        layout, backend, padding, ep, tp, router = case
        if (ep, tp) not in groups:  # new_group is collective: every rank walks the same case list
            groups[ep, tp] = moe_group(rank, world, ep, tp)
        group = groups[ep, tp]
        g = dist.get_rank(group)
        spec = moe_spec(router, options.intermediate)
        moe_layout = MoeLayout(
            layout=layout, backend=backend, dp_padding=padding, low_latency=options.low_latency,
            max_rows_per_rank=options.max_rows_per_rank, ep_rank=g // tp, ep_size=ep, tp_rank=g % tp, tp_size=tp,
            num_experts=spec.num_experts, hidden_size=options.hidden, top_k=spec.top_k,
            device_type=torch.device(options.device).type,
        )  # fmt: skip
        dispatcher = make_dispatcher(moe_layout, group)
        full = reference_moe(spec, 100 + case_idx, options)
        moe = sharded_moe(full, dispatcher, options)
        rng = random.Random(case_idx)  # same sequence on every rank
        r = {"worst": 0.0, "max_dy": 0.0, "mean_dy": 0.0, "compared": 0, "skipped": 0, "idle": 0}
        for _ in range(num_steps):
            counts = step_counts(rng, world, step_id)
            plan = sync.sync(step_id, counts[rank])
            step_id += 1
            if plan.skip:
                r["skipped"] += 1
                continue
            gen = torch.Generator().manual_seed(step_id * 1000 + rank)
            x = torch.randn(counts[rank], options.hidden, generator=gen).to(options.device, options.dtype)
            with torch.no_grad():
                y = moe(x, plan)
                ref = full(x)
            if y.shape != ref.shape or y.dtype != ref.dtype:
                raise AssertionError(
                    f"case {case} step {step_id}: {tuple(y.shape)} {y.dtype} != reference {tuple(ref.shape)} {ref.dtype}"
                )
            if not x.shape[0]:
                r["idle"] += 1
                continue
            dy, ref32 = (y.float() - ref.float()).abs(), ref.float().abs()
            scale = ref32.mean().clamp_min(1e-12)
            r["worst"] = max(r["worst"], (dy.max() / ref32.max().clamp_min(1e-12)).item())
            r["max_dy"] = max(r["max_dy"], (dy.max() / scale).item())
            r["mean_dy"] = max(r["mean_dy"], (dy.mean() / scale).item())
            r["compared"] += 1
        dispatcher.close()
        report[case] = r
    return report
