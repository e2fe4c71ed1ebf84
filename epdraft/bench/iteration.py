"""`epdraft bench iteration [--preset P | --draft DIR]`: the draft's whole iteration, as an engine pays it, on one GPU against its floor.

One iteration is what an embedded DraftRuntime runs between two target verifies when the engine
passes its DP counts (one rank here: no sync): `commit` of the verified rows (1 .. num_drafts + 1
per request, drawn at random, their target features random) into the draft's context, then
`propose` (the draft step). For each batch N (`--requests`) and context (`--context`), with
random weights and a random context of exactly that length before every timed call (reset outside
the timing), it times side by side (CUDA events, median of `--steps` after `--warmup`, alternating):
`commit` and `propose` each replayed from their CUDA graphs, `graph` (the two back to back, what an
engine's iteration costs under `draft.cuda_graphs`) and `eager` (the same two eagerly). Each starts
from an idle GPU, so the host's launches are in it; `device ms` (and `prop dev`, the same of
`propose`) is the graph iteration again queued behind a sleep kernel (`bench.step.device_ms`): the
device's time alone, what an engine whose host runs ahead of the GPU pays.

Floors are max(bytes / copy bandwidth, FLOPs / matrix rate) from the shapes (both measured on this
kind of GPU: `bench.ceilings`, `bench.step.TENSOR_FLOPS`): `propose floor` is `bench step`'s (the
weights the step reads, the experts its routing picked, the lm_head, the K/V it reads and writes,
over the context the commit left: `context` + its mean rows); the iteration's adds
what only the commit touches: the features' projection (fc / main_proj), the committed rows'
features read and their K/V written to the pool (the K/V projections both read are counted once).
`op floor` takes that max per op (each weight matrix, each layer's experts, the context read, the
lm_head, the commit) and sums them: kernels run one after another, so a FLOP-bound lm_head cannot
hide under byte-bound experts as the whole's max assumes. The issue's ratio is `graph/floor`.
Prints a table and one JSON line per point (`--json FILE` appends); `--plot FILE.png` draws the
iteration's graph time and floor against N (`--from-json FILE --plot OUT.png` from a saved file).
`kernels` / `busy ms`: the CUDA kernels of one commit (its `write_context` eagerly, at the graph's
padded shapes, launched without PDL) and their summed device time; `--profile K` lists the K
costliest after the table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from epdraft.bench.ceilings import memory_bytes_per_s
from epdraft.bench.drafts import random_draft
from epdraft.bench.step import (
    RandomHeads, _ints, _profile, add_draft_arguments, device_ms, emit, op_floor_seconds, preset_draft_config,
    print_profiles, step_costs, time_alternately_ms, touched_experts, whole_floor_seconds,
)  # fmt: skip
from epdraft.bench.step_plot import plot, pyplot, read_results
from epdraft.dispatch import StepPlan
from epdraft.errors import ConfigError
from epdraft.kernels import launch

WHAT = "draft iteration (commit + propose)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_draft_arguments(parser)
    parser.add_argument("--profile", type=int, default=0, metavar="K",
                        help="after the table, the K kernels that take the most time in one commit, per point")
    parser.add_argument("--json", type=Path, help="append the JSON lines to this file")
    parser.add_argument("--plot", type=Path, help="write iteration time vs N against the floor to this PNG")
    parser.add_argument("--from-json", type=Path, metavar="FILE",
                        help="with --plot: draw the plot from this saved --json file instead of running the bench")


def commit_cost(draft, pool, rows: float) -> tuple[float, float]:
    """(bytes, FLOPs) a commit of `rows` rows adds to a step's: the features' projection weights
    (read by the commit only), the rows' features read, their K/V written; FLOPs of that projection
    and of every layer's K/V projection over the rows (their weights the step reads too: counted there)."""
    spec = draft.spec
    prefix = "main_proj." if spec.deepseek is not None else "fc."
    fc = [p for name, p in draft.named_parameters() if name.startswith(prefix)]
    kv = [p for name, p in draft.named_parameters() if name.endswith(("k_proj.weight", "v_proj.weight", "kv_proj.weight"))]
    width = spec.num_target_features * spec.hidden_size
    itemsize = pool.dtype.itemsize
    nbytes = sum(p.numel() * p.element_size() for p in fc) + rows * (width * itemsize + pool.bytes_per_position)
    flops = 2.0 * rows * sum(p.numel() for p in fc + kv if p.dim() == 2)
    return nbytes, flops


def main(args: argparse.Namespace) -> int:
    from epdraft.config.hf import read_config_json
    from epdraft.models.spec import DraftModelSpec
    from epdraft.runtime.graphs import CommitGraphs, StepGraphs

    if args.from_json:
        if args.plot is None:
            raise ConfigError(f"--from-json {args.from_json} draws a plot from saved results: add --plot OUT.png")
        plot(pyplot(args.plot), read_results(args.from_json), args.plot, kind="iteration", what=WHAT)
        return 0
    plt = pyplot(args.plot) if args.plot else None
    requests, contexts = _ints(args.requests, "--requests"), _ints(args.context, "--context")
    if args.profile < 0:
        raise ConfigError(f"--profile {args.profile}: the number of kernels to list must be >= 0")
    if not torch.cuda.is_available():
        raise ConfigError("epdraft bench iteration times the GPU iteration: it needs CUDA")
    spec = DraftModelSpec.from_config(read_config_json(args.draft) if args.draft else preset_draft_config(args.preset))
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    draft = random_draft(spec, dtype=torch.bfloat16, device=device)
    heads = RandomHeads(spec.vocab_size, spec.hidden_size, dtype=torch.bfloat16, device=device)
    B, R = spec.block_size, spec.num_drafts + 1
    width = spec.num_target_features * spec.hidden_size
    label = str(args.draft) if args.draft else args.preset
    bytes_per_s, ceiling = memory_bytes_per_s(torch.cuda.get_device_name())
    print(f"draft {label}: H {spec.hidden_size}, {spec.num_layers} layers, block {B}, commits 1..{R} rows per request, "
          f"bf16, {torch.cuda.get_device_name()}; floor at the {ceiling}")
    print(f"{'N':>5}{'context':>9}{'rows':>6}{'commit ms':>11}{'propose ms':>11}{'prop floor':>11}{'prop/floor':>11}"
          f"{'prop dev':>10}{'graph ms':>10}{'device ms':>11}{'eager ms':>10}{'floor ms':>10}{'graph/floor':>12}"
          f"{'op floor':>10}{'graph/op':>9}{'kernels':>9}{'busy ms':>9}")  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(1)
    results, profiles = [], []
    for context in contexts:
        pool = draft.new_pool(max_requests=max(requests), max_context=context + R)
        for slot in range(max(requests)):
            pool.admit(slot)
        for rows in pool.buffers:
            rows.normal_()
        step_graphs = StepGraphs(
            lambda s, a, plan, readout: draft.step(pool, s, a, heads, plan, readout=readout), pad_slot=pool.pad_slot,
            buckets=tuple(sorted(set(requests))), block_size=B, device=device,
        )  # fmt: skip
        commit_graphs = CommitGraphs(
            lambda s, c, f: draft.write_context(pool, s, c, f), pad_slot=pool.pad_slot,
            buckets=tuple(sorted(set(requests))), rows_per_request=R, width=width, dtype=pool.dtype, device=device,
        )  # fmt: skip
        for n in requests:
            ids = list(range(n))
            slots_N = torch.arange(n, device=device)
            anchors_N = torch.randint(0, spec.vocab_size - 1, (n,), device=device, generator=gen)
            anchors = anchors_N.tolist()
            plan = StepPlan(step=0, ranks=(0,), counts=(n * B,))
            # A few verify outcomes to cycle through: counts 1..R per request, the rows' features.
            outcomes = []
            for _ in range(4):
                counts = torch.randint(1, R + 1, (n,), generator=gen, device=device).tolist()
                outcomes.append((counts, torch.randn(sum(counts), width, generator=gen, device=device).to(pool.dtype)))
            turn = [0]

            def reset() -> None:  # every timed call starts from a context of exactly `context` rows
                for rid in ids:
                    pool.set_length(rid, context)
                turn[0] = (turn[0] + 1) % len(outcomes)

            def commit_graph() -> None:
                counts, rows = outcomes[turn[0]]
                commit_graphs.run(ids, counts, rows)
                for rid, c in zip(ids, counts):
                    pool.book(rid, c)

            def propose_graph() -> None:
                step_graphs.run(ids, anchors, plan)

            def iteration_graph() -> None:
                commit_graph()
                propose_graph()

            def iteration_eager() -> None:
                counts, rows = outcomes[turn[0]]
                draft.extend(pool, ids, list(rows.split(counts)))
                draft.step(pool, slots_N, anchors_N, heads, plan)

            with torch.no_grad():
                commit, propose, graph, eager = time_alternately_ms(
                    [commit_graph, propose_graph, iteration_graph, iteration_eager], args.steps, args.warmup, before=reset
                )  # fmt: skip
                graph_device = device_ms(iteration_graph, args.steps, before=reset)
                propose_device = device_ms(propose_graph, args.steps, before=reset)
                reset()
                counts, rows = outcomes[0]
                padded = torch.zeros(n * R, width, dtype=pool.dtype, device=device)
                padded[: rows.shape[0]] = rows
                counts_N = torch.tensor(counts, device=device)
                with launch.pdl_off():  # a PDL kernel's time would count its wait for the one before
                    kernels, busy_us, top = _profile(lambda: draft.write_context(pool, slots_N, counts_N, padded),
                                                     args.profile)  # fmt: skip
                reset()
                touched = touched_experts(draft, lambda: draft.step(pool, slots_N, anchors_N, heads, plan))
            mean_rows = sum(sum(c) for c, _ in outcomes) / len(outcomes)
            # the step after the commit reads its rows too: context + the commit's rows per request
            propose_costs = step_costs(draft, heads, n, context + mean_rows / n, touched)
            costs = propose_costs + [commit_cost(draft, pool, mean_rows)]
            floor_s, nbytes, flops = whole_floor_seconds(costs, bytes_per_s)
            floor = floor_s * 1e3
            op_floor = op_floor_seconds(costs, bytes_per_s) * 1e3
            propose_floor = whole_floor_seconds(propose_costs, bytes_per_s)[0] * 1e3
            row = dict(kind="iteration", preset=label, requests=n, context=context, rows_per_request=mean_rows / n,
                       commit_graph_ms=commit, propose_graph_ms=propose, propose_floor_ms=propose_floor,
                       propose_device_ms=propose_device, graph_ms=graph, graph_device_ms=graph_device, eager_ms=eager,
                       floor_ms=floor, op_floor_ms=op_floor, bytes=int(nbytes), flops=flops, experts_touched=touched,
                       commit_kernels=kernels, commit_busy_ms=busy_us / 1e3, device=torch.cuda.get_device_name(),
                       torch=torch.__version__)  # fmt: skip
            results.append(row)
            print(f"{n:>5}{context:>9}{mean_rows / n:>6.1f}{commit:>11.3f}{propose:>11.3f}{propose_floor:>11.3f}"
                  f"{propose / propose_floor:>11.2f}{propose_device:>10.3f}{graph:>10.3f}{graph_device:>11.3f}"
                  f"{eager:>10.3f}{floor:>10.3f}{graph / floor:>12.2f}{op_floor:>10.3f}{graph / op_floor:>9.2f}"
                  f"{kernels:>9}{busy_us / 1e3:>9.3f}")  # fmt: skip
            if args.profile:
                profiles.append((n, context, busy_us, top))
        del step_graphs, commit_graphs, pool
        torch.cuda.empty_cache()
    print_profiles(profiles, "one commit")
    emit(results, args, plt, kind="iteration", what=WHAT)
    return 0
