"""Shared rank-side code of the dispatch equivalence tests: one spawned world runs many cases.

Each case builds a single-process DraftMoE holding every expert (the reference) and this rank's
sharded DraftMoE (its e = E/ep experts and F = I/tp slice, weights sliced from the reference),
then runs many steps of random per-rank row counts through StepSync -> DraftMoE and compares
every rank's output with the reference on the same rows.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from epdraft.config.ffn import DraftMoeFFNSpec, RouterSpec
from epdraft.dispatch.factory import make_dispatcher
from epdraft.layers.moe import DraftMoE
from epdraft.layers.moe_context import MoeContext
from epdraft.worker.dp_sync import StepSync

HIDDEN = 16
INTERMEDIATE = 8
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


def moe_spec(router: str) -> DraftMoeFFNSpec:
    return DraftMoeFFNSpec(router=ROUTERS[router], intermediate_size=INTERMEDIATE, shared_intermediate_size=12)


def reference_moe(spec: DraftMoeFFNSpec, seed: int) -> DraftMoE:
    """The single-process DraftMoE with all experts, random weights (same on every rank)."""
    moe = DraftMoE(spec, HIDDEN)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return moe


def sharded_moe(full: DraftMoE, ctx: MoeContext) -> DraftMoE:
    """This rank's DraftMoE: experts [ep_rank*e, (ep_rank+1)*e), intermediate rows [tp_rank*F, (tp_rank+1)*F)."""
    spec = full.spec
    moe = DraftMoE(spec, HIDDEN, moe_context=ctx)
    e = spec.num_experts // ctx.ep_size
    F_ = spec.intermediate_size // ctx.tp_size
    experts = slice(ctx.ep_rank * e, (ctx.ep_rank + 1) * e)
    f = slice(ctx.tp_rank * F_, (ctx.tp_rank + 1) * F_)
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


def run_cases(rank: int, world: int, cases: list[tuple], num_steps: int) -> dict:
    """Run every (layout, backend, dp_padding, ep, tp, router) case for num_steps steps.

    Returns per-case counts of compared steps and skipped steps, and the worst relative error.
    """
    sync = StepSync(dist.group.WORLD)
    step_id = 0
    report = {}
    for case_idx, (layout, backend, padding, ep, tp, router) in enumerate(cases):
        group = moe_group(rank, world, ep, tp)
        g = dist.get_rank(group)
        spec = moe_spec(router)
        dispatcher = make_dispatcher(
            layout, backend, group, spec.num_experts, HIDDEN, ep_size=ep, tp_size=tp, dp_padding=padding, top_k=spec.top_k
        )
        ctx = MoeContext(ep_rank=g // tp, ep_size=ep, tp_rank=g % tp, tp_size=tp, dispatcher=dispatcher)
        full = reference_moe(spec, seed=100 + case_idx)
        moe = sharded_moe(full, ctx)
        rng = random.Random(case_idx)  # same sequence on every rank
        worst, compared, skipped = 0.0, 0, 0
        for _ in range(num_steps):
            counts = step_counts(rng, world, step_id)
            plan = sync.sync(step_id, counts[rank])
            step_id += 1
            if plan.skip:
                skipped += 1
                continue
            ctx.begin_step(plan)
            gen = torch.Generator().manual_seed(step_id * 1000 + rank)
            x = torch.randn(counts[rank], HIDDEN, generator=gen)
            with torch.no_grad():
                y = moe(x)
                ref = full(x)
            if y.shape != ref.shape:
                raise AssertionError(f"case {cases[case_idx]} step {step_id}: shape {tuple(y.shape)} != {tuple(ref.shape)}")
            if x.shape[0]:
                err = ((y - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
                worst = max(worst, err)
                compared += 1
        dispatcher.close()
        report[(layout, padding, ep, tp, router)] = {"worst": worst, "compared": compared, "skipped": skipped}
    return report
