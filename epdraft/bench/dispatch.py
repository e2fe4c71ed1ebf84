"""`epdraft bench dispatch --config C --rows N`: median step time of each MoE layout, per phase.

Spawns the config's ranks on this host as CPU processes over gloo (whatever the config's device:
this measures the layouts' protocol cost, not a GPU), builds the config's groups, and for every
layout the config's moe_ep x moe_tp allows runs `--steps` steps of one synthetic MoE layer with
N rows per rank, timing sync (StepSync), dispatch, experts and combine. A phase's time per step is
the slowest rank's; the table shows medians. Prints the table and one JSON line per layout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from epdraft.config.ffn import DraftMoeFFNSpec, RouterSpec
from epdraft.config.parallel import ParallelConfig, load_parallel_config
from epdraft.errors import ConfigError
from epdraft.worker.spawn import run_local_ranks

PHASES = ("sync", "dispatch", "experts", "combine")
CPU_OVERRIDES = ('cluster.device="cpu"', 'cluster.backend="gloo"', 'draft.a2a_backend="torch"')


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="parallel config (.toml/.yaml/.json); its ranks run here")
    parser.add_argument("--rows", type=int, required=True, help="rows per rank per step")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per layout (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per layout first (default 3)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size H (default 1024)")
    parser.add_argument("--experts", type=int, default=8, help="routed experts E (default 8)")
    parser.add_argument("--top-k", type=int, default=2, help="top-k (default 2)")
    parser.add_argument("--intermediate", type=int, default=512, help="per-expert intermediate size I (default 512)")
    parser.add_argument("--json", type=Path, default=None, help="also append the JSON lines to this file")


def layouts(pc: ParallelConfig) -> list[tuple[str, str]]:
    """(layout, dp_padding) pairs the config's moe_ep x moe_tp can run."""
    d = pc.draft
    out = [("replicated", "max_len")]
    if d.moe_group_size > 1:
        if d.moe_tp == 1:
            out.append(("alltoall", "max_len"))
        out += [("gather", "max_len"), ("gather", "sum_len")]
    return out


def _time_layouts(
    rank: int, world: int, pc: ParallelConfig, spec: DraftMoeFFNSpec, hidden: int, a: dict
) -> list[dict]:
    """One rank's loop: every layout, warmup + steps; returns rank 0's medians (others return [])."""
    from epdraft.dispatch.factory import make_dispatcher
    from epdraft.layers.moe import DraftMoE
    from epdraft.layers.moe_context import MoeContext
    from epdraft.worker.dp_sync import StepSync
    from epdraft.worker.groups import Groups

    groups = Groups.from_config(pc)
    sync = StepSync(groups.cpu)
    x = torch.randn(a["rows"], hidden, generator=torch.Generator().manual_seed(rank))
    results, step = [], 0
    for layout, padding in layouts(pc):
        sharded = layout != "replicated"
        dispatcher = make_dispatcher(
            layout, "torch", groups.moe if sharded else None, spec.num_experts, hidden,
            ep_size=groups.ep_size if sharded else 1, tp_size=groups.tp_size if sharded else 1,
            dp_padding=padding, top_k=spec.top_k,
        )
        ctx = groups.moe_context(dispatcher) if sharded else MoeContext()
        moe = DraftMoE(spec, hidden, moe_context=ctx)
        with torch.no_grad():
            for p in moe.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.02)
        times = {p: [] for p in PHASES}
        with torch.no_grad():
            for i in range(a["warmup"] + a["steps"]):
                t0 = time.perf_counter()
                plan = sync.sync(step, x.shape[0])
                ctx.begin_step(plan)
                ids, weights = moe.router(x)
                t1 = time.perf_counter()
                handle = dispatcher.dispatch(x, ids, weights, plan)
                t2 = time.perf_counter()
                y = moe.experts(handle.rows_RH, handle.ids_RK, handle.weights_RK)
                t3 = time.perf_counter()
                dispatcher.combine(y, handle)
                t4 = time.perf_counter()
                step += 1
                if i >= a["warmup"]:
                    for phase, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                        times[phase].append(dt * 1e3)
        dispatcher.close()
        everyone = [None] * world
        dist.all_gather_object(everyone, times)
        slowest = {p: [max(r[p][s] for r in everyone) for s in range(a["steps"])] for p in PHASES}
        medians = {p: statistics.median(v) for p, v in slowest.items()}
        medians["step"] = statistics.median([sum(slowest[p][s] for p in PHASES) for s in range(a["steps"])])
        results.append({"layout": layout, "dp_padding": padding, "median_ms": medians})
    return results if rank == 0 else []


def main(args: argparse.Namespace) -> int:
    if args.rows < 0 or args.steps < 1 or args.warmup < 0:
        raise ConfigError(f"--rows {args.rows} must be >= 0, --steps {args.steps} >= 1, --warmup {args.warmup} >= 0")
    pc = load_parallel_config(args.config, CPU_OVERRIDES)
    spec = DraftMoeFFNSpec(
        router=RouterSpec(num_experts=args.experts, top_k=args.top_k), intermediate_size=args.intermediate
    )
    a = {"rows": args.rows, "steps": args.steps, "warmup": args.warmup}
    # Ranks are killed at twice the collective timeout: a hang shows up as a ParallelError naming them.
    results = run_local_ranks(
        pc.world_size, _time_layouts, pc, spec, args.hidden, a,
        timeout_s=2 * pc.cluster.timeout_s, pg_timeout_s=pc.cluster.timeout_s,
    )[0]
    d = pc.draft
    header = {
        "bench": "dispatch",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": str(args.config),
        "world": pc.world_size,
        "moe_ep": d.moe_ep,
        "moe_tp": d.moe_tp,
        "rows_per_rank": args.rows,
        "steps": args.steps,
        "hidden": args.hidden,
        "experts": args.experts,
        "top_k": args.top_k,
        "intermediate": args.intermediate,
        "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), gloo",
        "torch": torch.__version__,
    }
    print(f"{pc.world_size} CPU ranks, moe_ep = {d.moe_ep}, moe_tp = {d.moe_tp}, {args.rows} rows/rank, "
          f"H = {args.hidden}, E = {args.experts}, top-{args.top_k}, I = {args.intermediate}; median of {args.steps} steps, ms")
    print(f"{'layout':<18}" + "".join(f"{p:>10}" for p in (*PHASES, "step")))
    lines = []
    for r in results:
        label = f"{r['layout']} ({r['dp_padding']})" if r["layout"] == "gather" else r["layout"]
        print(f"{label:<18}" + "".join(f"{r['median_ms'][p]:>10.3f}" for p in (*PHASES, "step")))
        lines.append(json.dumps({**header, **r}))
    print("\n".join(lines))
    if args.json is not None:
        with args.json.open("a") as f:
            f.write("\n".join(lines) + "\n")
    return 0
