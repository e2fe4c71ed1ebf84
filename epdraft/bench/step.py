"""`epdraft bench step [--preset P | --draft DIR]`: the whole draft step on one GPU against its floor.

For each batch N (`--requests`) and context length (`--context`), with random weights and a
random context already in the KV pool, it times (CUDA events, median of `--steps` after
`--warmup`, replicated layout, one rank) the draft step these ways: `cache`, the cache-based
eager step (what `DraftRuntime` ran before the KV pool); `eager`, the pooled step; `graph`, the
pooled step replayed from a CUDA graph; `no-pdl`, the same graph captured with programmatic
dependent launch off (`epdraft.kernels.launch`: on by default on sm_90+); `sampled`, the graph of
the sampled readout with every request at `--temperature` (`--top-k`, `--top-p`): what sampling
adds to a step, timed alternately with the greedy graph (`sampled/graph` is over that greedy
time, not the `graph` column's). The floor is max(bytes / copy bandwidth, FLOPs / matrix rate)
counted from the shapes (both measured on this kind of GPU: `bench.ceilings`, TENSOR_FLOPS): the
draft's non-expert weights, the experts the step's routing picked (counted in one eager step:
random weights route unevenly), the lm_head (its FLOPs over the drafting rows), the context K/V
read and the block's K/V written; not the logits nor the layers' activations (a few MB a layer,
which the L2 can hold: a fused lm_head + argmax would not write the logits); `op floor` takes that max
per op and sums it (`op_floor_seconds`: kernels that run one after another cannot overlap the
FLOP-bound projections with the byte-bound experts). `kernels` is the eager
pooled step's CUDA kernel count and `busy ms` their summed device time (torch profiler, launched
without PDL: with it a kernel's time would include its wait for the kernel before): a graph step
longer than `busy` spends the difference between launches; `--profile K` prints its K costliest
kernels. Prints a table and one JSON line per point (`--json FILE`
appends them); `--plot FILE.png` draws graph step time and floor against N (needs matplotlib:
`pip install 'epdraft[plot]'`), and `--from-json FILE --plot OUT.png` draws it from a saved
`--json` file without running anything (no GPU needed: plot on a machine that has matplotlib).

`--weights bf16,quantized` (a DeepSeek DSpark draft only) builds the draft a second time in DeepSeek's
released layout as loading holds it (`bench.drafts.quantized_twin`: the same random weights through the
project's quantizers, in memory: FP4 experts held as the fused kernels' mxfp4, FP8 linears dequantized to
bf16 at load) and times both side by side (eager and graph steps alternately, CUDA events), each against
its own floor, counted on the bytes its step reads (mxfp4 experts: values + e8m0 scales); `rel floor` is
the floor on the released bytes (FP8 linears at one byte + e8m0 block scales): what an FP8 GEMM would
reach (`epdraft bench linear` times it). The default, `--weights bf16`, is the bf16 draft alone.

`--attention` adds one layer's block attention alone, per point: `triton` (the kernel, reading the
pool in place), `sdpa` (torch SDPA on K/V already gathered contiguous, a length mask), `flex`
(torch's flex_attention on the same gathered K/V with a length mask_mod, compiled by torch.compile
once per shape; its block mask is built once, outside the timing), `sdpa+gather` (the reference:
the gather a pool needs, then SDPA), and the floor (the K/V bytes at HBM speed). flex is timed only
after its output matched the fp32 reference (max |dy| printed); when flex_attention cannot be
imported, compiled or does not match, its column is `-` and one line says why.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch

from epdraft.bench.ceilings import memory_bytes_per_s
from epdraft.bench.step_plot import plot, pyplot, read_results
from epdraft.config.sampling import SamplingParams, parse_sampling
from epdraft.dispatch import StepPlan
from epdraft.errors import ConfigError
from epdraft.kernels import launch
from epdraft.sampling import Readout, seeded

# bf16 dense matrix rate: an 8192^3 product on random data ran at 769-798 TFLOP/s on the H100s and
# 788 on the H200 here (the device library's KINDS.md); the datasheets' 989 is not reached
TENSOR_FLOPS = 790e12

PRESETS: dict[str, dict] = {
    "issue13": dict(hidden=4096, heads=32, kv_heads=8, layers=5, experts=8, moe_intermediate=1536, top_k=2,
                    vocab=32000, block_size=16),
    "v4like": dict(hidden=5120, heads=40, kv_heads=8, layers=5, experts=128, moe_intermediate=2304, top_k=3,
                   vocab=129280, block_size=16),
}  # fmt: skip
# DeepSeek-V4.1-Flash's own DSpark draft at its released sizes (issue 31; SpecForge's converted config
# keys), timed in bf16 and, with --weights bf16,quantized, also in its released FP8 / FP4 layout (issue 32).
DSPARK_PRESETS: dict[str, dict] = {
    "v41-flash": {
        "architectures": ["DSparkV4DraftModel"], "model_type": "deepseek_v4_dspark_draft", "block_size": 5,
        "dflash_config": {"attention_mode": "deepseek_v41", "context_window": 128, "confidence_head_with_markov": True,
                          "enable_confidence_head": True, "kv_fake_quant": True, "markov_head_type": "vanilla",
                          "markov_rank": 256, "mask_token_id": 128799, "projector_type": "dspark_v4",
                          "target_layer_ids": [37, 38, 39]},
        "hidden_size": 4096, "vocab_size": 129280, "num_hidden_layers": 3, "num_target_layers": 40,
        "rms_norm_eps": 1e-6, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_lora_rank": 1024, "o_groups": 8, "rope_theta": 10000.0,
        "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 3, "moe_intermediate_size": 2304,
        "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4,
        "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    },
}  # fmt: skip


def preset_draft_config(name: str) -> dict:
    """The draft config.json of a `--preset` name."""
    return DSPARK_PRESETS[name] if name in DSPARK_PRESETS else preset_config(PRESETS[name])


def add_draft_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every single-GPU draft bench shares: which draft, which batches and contexts, how long."""
    parser.add_argument("--preset", choices=sorted({*PRESETS, *DSPARK_PRESETS}), default="issue13", help="draft shape (default issue13)")
    parser.add_argument("--draft", type=Path, help="a draft export directory instead of a preset (its config only)")
    parser.add_argument("--requests", default="1,8,32,64,128", help="batch sizes N, comma list")
    parser.add_argument("--context", default="1024,8192", help="context rows per request, comma list")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_draft_arguments(parser)
    parser.add_argument("--no-cache-path", action="store_true", help="skip the cache-based eager step (slow at large N)")
    parser.add_argument("--attention", action="store_true",
                        help="also time one layer's block attention alone: the Triton kernel against SDPA and "
                             "flex_attention (compiled per shape)")
    parser.add_argument("--profile", type=int, default=0, metavar="K",
                        help="after the table, the K kernels that take the most time in one eager step, per point")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="the `sampled` column: the graph step with every request sampling at this "
                        "temperature (default 0.8; 0 leaves the column out)")
    parser.add_argument("--top-p", type=float, default=1.0, help="the `sampled` column's top-p (default 1: none)")
    parser.add_argument("--top-k", type=int, default=None, help="the `sampled` column's top-k (default none)")
    parser.add_argument("--weights", default="bf16",
                        help="comma list: bf16 (the draft in bf16, default) and quantized (a DeepSeek DSpark draft "
                        "in its released layout as loading holds it: FP4 experts in the fused kernels, FP8 linears "
                        "dequantized at load), each timed side by side against its own floor")
    parser.add_argument("--json", type=Path, help="append the JSON lines to this file")
    parser.add_argument("--plot", type=Path, help="write step time vs N against the floor to this PNG")
    parser.add_argument("--from-json", type=Path, metavar="FILE",
                        help="with --plot: draw the plot from this saved --json file instead of running the bench "
                             "(the last run of each preset, context and N; the other options are not used)")


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected a comma list of integers") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} {text!r}: expected integers >= 1")
    return values


def preset_config(p: dict) -> dict:
    """A SpecForge DFlash MoE config.json (qwen3_5_moe preset, gated shared expert) of preset `p`."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": p["hidden"],
        "num_attention_heads": p["heads"], "num_key_value_heads": p["kv_heads"], "head_dim": 128,
        "num_hidden_layers": p["layers"], "intermediate_size": 4 * p["hidden"], "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "vocab_size": p["vocab"], "num_target_layers": 8,
        "block_size": p["block_size"], "moe_preset": "qwen3_5_moe", "n_routed_experts": p["experts"],
        "num_experts_per_tok": p["top_k"], "moe_intermediate_size": p["moe_intermediate"],
        "shared_expert_intermediate_size": p["moe_intermediate"], "n_shared_experts": 1,
        "dflash_config": {"block_size": p["block_size"], "mask_token_id": p["vocab"] - 1, "target_layer_ids": [1, 4, 6]},
    }  # fmt: skip


class RandomHeads(torch.nn.Module):
    """A target's embedding and lm_head with random weights (what the draft reads through)."""

    def __init__(self, vocab: int, hidden: int, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, hidden, dtype=dtype, device=device)
        self.head = torch.nn.Linear(hidden, vocab, bias=False, dtype=dtype, device=device)
        torch.nn.init.normal_(self.embedding.weight, std=0.02)
        torch.nn.init.normal_(self.head.weight, std=hidden**-0.5)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


def floor_seconds(
    draft, heads: RandomHeads, n: int, context: int, bytes_per_s: float, touched: list[int] | None = None,
    nbytes: Callable[[str, torch.Tensor], int] | None = None,
) -> tuple[float, int, float]:
    """(floor s, bytes, FLOPs) of one step over n requests of `context` rows, from the shapes, at
    `bytes_per_s` of memory (`ceilings.memory_bytes_per_s`): max(all bytes / bandwidth, all FLOPs /
    TENSOR_FLOPS), as if the step's memory-bound and compute-bound work overlapped (`op_floor_seconds`
    does not assume that). `touched`: the distinct experts each MoE layer's routing picked
    (`touched_experts`); None: the count uniform routing would expect. Each tensor counts the bytes
    it is held in (a quantized expert's values and scales, `drafts.expert_bytes`); `nbytes(name,
    tensor)` counts the non-expert tensors otherwise (`drafts.released_bytes`: as released). FLOPs
    come from the logical shapes, whatever the storage."""
    return whole_floor_seconds(step_costs(draft, heads, n, context, touched, nbytes), bytes_per_s)


def whole_floor_seconds(costs: list[tuple[float, float]], bytes_per_s: float) -> tuple[float, int, float]:
    """(floor s, bytes, FLOPs) of ops' (bytes, FLOPs) taken as one whole: max(all bytes / bandwidth,
    all FLOPs / TENSOR_FLOPS) (`floor_seconds`; `op_floor_seconds` bounds each op on its own)."""
    total, flops = sum(b for b, _ in costs), sum(f for _, f in costs)
    return max(total / bytes_per_s, flops / TENSOR_FLOPS), int(total), flops


def op_floor_seconds(costs: list[tuple[float, float]], bytes_per_s: float) -> float:
    """The floor of ops that run one after another: each op's own max(bytes / bandwidth, FLOPs /
    TENSOR_FLOPS), summed. At many rows the step's dense projections and lm_head are bound by
    FLOPs while its experts and context reads are bound by bytes; `floor_seconds` lets those
    overlap, which kernels run in sequence cannot do."""
    return sum(max(b / bytes_per_s, f / TENSOR_FLOPS) for b, f in costs)


def step_costs(
    draft, heads: RandomHeads, n: int, context: int, touched: list[int] | None = None,
    nbytes: Callable[[str, torch.Tensor], int] | None = None,
) -> list[tuple[float, float]]:
    """(bytes, FLOPs) of each op of one step (`floor_seconds`' arguments): every weight matrix (a
    GEMM over the step's rows; vectors are bytes only), each MoE layer's experts, the context read
    with the attention's FLOPs, the lm_head."""
    from epdraft.bench.drafts import expert_bytes
    from epdraft.layers.moe import DraftMoE

    spec, B = draft.spec, draft.block_size
    moe_index = 0
    rows = n * B
    # The target features' projection runs on the context (extend), not in the step.
    features = "main_proj." if spec.deepseek is not None else "fc."
    costs: list[tuple[float, float]] = []
    for name, p in draft.named_parameters():
        if ".experts." not in name and not name.startswith(features):
            held = nbytes(name, p) if nbytes is not None else p.numel() * p.element_size()
            costs.append((held, 2.0 * rows * p.numel() if p.dim() == 2 else 0.0))
    for m in draft.modules():
        if isinstance(m, DraftMoE):
            E, K = m.spec.num_experts, m.spec.top_k
            hit = touched[moe_index] if touched is not None else E * (1 - (1 - 1 / E) ** (rows * K))
            moe_index += 1
            costs.append((hit * expert_bytes(m.experts),
                          2.0 * rows * K * 3 * m.experts.shard.slice_size * m.experts.shard.hidden_size))  # fmt: skip
    costs.append(_context_read(draft, n, context))
    head = heads.head.weight  # over the drafting rows only (`draft_rows`: B - 1 of a mask-filling block)
    costs.append((head.numel() * head.element_size(), 2.0 * n * spec.num_drafts * head.numel()))
    return costs


def touched_experts(draft, step) -> list[int]:
    """The distinct experts each MoE layer's router picks in one call of `step()` (an eager step):
    random weights route unevenly, to fewer experts than uniform routing would, so a floor from the
    expected count would be too high."""
    from epdraft.layers.moe import DraftMoE

    picked: list[set[int]] = []
    hooks = []
    for m in draft.modules():
        if isinstance(m, DraftMoE):
            picked.append(set())
            hooks.append(m.router.register_forward_hook(
                lambda _m, _args, out, ids=picked[-1]: ids.update(out[0].flatten().tolist())))  # fmt: skip
    try:
        step()
    finally:
        for hook in hooks:
            hook.remove()
    return [len(ids) for ids in picked]


def _context_read(draft, n: int, context: int) -> tuple[int, float]:
    """(bytes of K/V the step moves, attention FLOPs) for n requests of `context` rows: each layer
    writes its block's B rows and reads them with the context's, a DFlash layer K and V of every
    row (g heads), a DeepSeek DSpark layer the one K=V row of the last `window` positions only."""
    spec, B, L = draft.spec, draft.block_size, draft.spec.num_layers
    itemsize = next(draft.parameters()).element_size()
    if spec.deepseek is not None:
        seen = min(draft.window, context)
        row_bytes, keys = spec.head_dim * itemsize, seen + B
    else:
        attn = draft.layers[0].self_attn
        row_bytes, keys = 2 * attn.num_kv_heads * attn.head_dim * itemsize, context + B
        seen = keys
    return L * n * (seen + B) * row_bytes, L * 4.0 * n * B * keys * spec.num_heads * spec.head_dim


def time_alternately_ms(fns, steps: int, warmup: int, before=None) -> list[float]:
    """Median ms (CUDA events) of each of `fns`, timed in turn (a, b, a, b, ...): a clock or thermal
    drift during the run moves them alike, so their ratio is what a side-by-side comparison means.
    `before()`, when given, runs ahead of every call, outside its events (e.g. resetting state)."""
    for _ in range(warmup):
        for fn in fns:
            if before is not None:
                before()
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(steps):
        for fn, out in zip(fns, times):
            if before is not None:
                before()
            out.append(_event_ms(fn))
    return [statistics.median(t) for t in times]


def _event_ms(fn) -> float:
    """ms between CUDA events recorded before and after `fn` (waits for the second)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


@functools.cache
def _sleep_cycles_per_ms() -> float:
    """How many cycles of `torch.cuda._sleep` take a millisecond on this GPU (measured once)."""
    torch.cuda._sleep(1000)
    return 1e6 / _event_ms(lambda: torch.cuda._sleep(1_000_000))


def device_ms(fn, steps: int, before=None, *, head_start_ms: float = 3.0) -> float:
    """Median ms (CUDA events) of `fn` on the device alone: each call is queued behind a sleep kernel
    of about `head_start_ms`, so the host has launched all of it before the GPU reaches it. Against
    `time_alternately_ms` (from an idle GPU, the host's launches included), the difference is the
    host time the GPU waited for: an engine whose host runs ahead pays the device time only."""
    cycles = int(head_start_ms * _sleep_cycles_per_ms())
    times = []
    for _ in range(steps):
        if before is not None:
            before()
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        times.append(_event_ms(fn))
    return statistics.median(times)


def _time_ms(fn, steps: int, warmup: int) -> float:
    return time_alternately_ms([fn], steps, warmup)[0]


def kernel_breakdown(kernels: list[tuple[str, float]], top: int) -> tuple[int, float, list[tuple[str, int, float]]]:
    """(kernel count, their summed device µs, the `top` names by time as (name, calls, µs)) of one
    step's kernels [(name, device µs)]: where the GPU's time goes, and, against the graph's
    wall time, how much of a step is gaps between launches."""
    by_name: dict[str, list] = {}
    for name, us in kernels:
        entry = by_name.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += us
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return len(kernels), sum(us for _, us in kernels), [(name, calls, us) for name, (calls, us) in ranked]


def _profile(fn, top: int) -> tuple[int, float, list[tuple[str, int, float]]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return kernel_breakdown([(e.name, e.device_time) for e in prof.events() if e.device_type.name == "CUDA"], top)


def _sampling_flags(args: argparse.Namespace) -> SamplingParams | None:
    """The `sampled` column's parameters (None: --temperature 0, no column); ConfigError naming the flag."""
    if args.temperature == 0:
        return None
    flags = {"temperature": args.temperature, "top_p": args.top_p}
    if args.top_k is not None:
        flags["top_k"] = args.top_k
    return parse_sampling(flags, "bench step")


def _weights_flag(text: str) -> list[str]:
    """`--weights` as a list of bf16 / quantized, each once; ConfigError naming the flag otherwise."""
    names = [w for w in text.split(",") if w]
    if not names or len(set(names)) != len(names) or not set(names) <= {"bf16", "quantized"}:
        raise ConfigError(f"--weights {text!r}: expected a comma list of bf16, quantized (each once)")
    return names


def _pool_and_graphs(draft, heads, requests: list[int], context: int, sampling, device):
    """(pool, graphs, no-PDL graphs) of `draft` for one context length: every slot the points use admitted
    (with the sampled column's params) and filled with a random context, as if extended."""
    from epdraft.runtime.graphs import StepGraphs

    pool = draft.new_pool(max_requests=max(requests), max_context=context)
    for slot in range(max(requests)):
        pool.admit(slot, seeded(sampling or SamplingParams(), 0, slot))
    for rows in pool.buffers:
        rows.normal_()
    pool.lengths.fill_(context)
    graphs, no_pdl_graphs = (StepGraphs(
        lambda s, a, plan, readout: draft.step(pool, s, a, heads, plan, readout=readout), pad_slot=pool.pad_slot,
        buckets=tuple(sorted(set(requests))), block_size=draft.block_size, device=device,
    ) for _ in range(2))  # fmt: skip
    return pool, graphs, no_pdl_graphs


def main(args: argparse.Namespace) -> int:
    from epdraft.bench.drafts import plain_config, quantized_twin, random_draft, release_block, release_config
    from epdraft.bench.drafts import released_bytes
    from epdraft.config.hf import read_config_json
    from epdraft.models.reference import reference_step
    from epdraft.models.spec import DraftModelSpec

    if args.from_json:
        if args.plot is None:
            raise ConfigError(f"--from-json {args.from_json} draws a plot from saved results: add --plot OUT.png")
        results = read_results(args.from_json)
        plot(pyplot(args.plot), results, args.plot)
        return 0
    plt = pyplot(args.plot) if args.plot else None  # before any timing: a bad --plot fails now, not after the run
    requests, contexts = _ints(args.requests, "--requests"), _ints(args.context, "--context")
    if args.profile < 0:
        raise ConfigError(f"--profile {args.profile}: the number of kernels to list must be >= 0")
    sampling = _sampling_flags(args)
    config = read_config_json(args.draft) if args.draft else preset_draft_config(args.preset)
    weights = _weights_flag(args.weights)
    spec = DraftModelSpec.from_config(plain_config(config) if "quantized" in weights else config)
    if "quantized" in weights and spec.deepseek is None:
        raise ConfigError(f"--weights quantized builds DeepSeek's released layout (FP4 experts, FP8 linears): a "
                          f"DeepSeek DSpark (dspark_v4) draft only, e.g. --preset v41-flash; this one is {spec.kind!r}")
    if spec.deepseek is not None and args.attention:
        raise ConfigError("--attention times the DFlash block-attention kernel; a DeepSeek DSpark (dspark_v4) "
                          "draft's attention has no kernel of its own yet")  # fmt: skip
    if not torch.cuda.is_available():
        raise ConfigError("epdraft bench step times the GPU step: it needs CUDA")
    cache_path = not args.no_cache_path and spec.deepseek is None  # DSpark V4 has no cache-based step
    device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    torch.manual_seed(0)
    drafts = {"bf16": random_draft(spec, dtype=dtype, device=device)}
    released = None  # bytes as DeepSeek releases them: the floor an FP8 GEMM would reach
    if "quantized" in weights:
        qconfig = config if "quantization_config" in config else release_config(config, release_block(spec))
        qspec = DraftModelSpec.from_config(qconfig)
        drafts["quantized"] = quantized_twin(drafts["bf16"], qspec)
        released = released_bytes(qspec.ffn.quantization.block[0])
    drafts = {w: drafts[w] for w in weights}
    heads = RandomHeads(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
    B, results = spec.block_size, []
    label = str(args.draft) if args.draft else args.preset
    bytes_per_s, ceiling = memory_bytes_per_s(torch.cuda.get_device_name())
    for w, draft in drafts.items():
        params = sum(p.numel() for p in draft.parameters()) / 1e9
        held = sum(p.numel() * p.element_size() for p in draft.parameters()) / 1e9
        print(f"draft {label} ({w}): H {spec.hidden_size}, {spec.num_layers} layers, block {B}, {params:.2f}B stored "
              f"values, {held:.2f} GB held, {torch.cuda.get_device_name()}; floor at the {ceiling}; kernels: "
              f"{draft.kernels.label}" + (f"; {draft.kernels.dequantized}" if draft.kernels.dequantized else ""))
    wide = released is not None  # the weights column and the floor on released bytes
    print(f"{'N':>5}{'context':>9}" + (f"{'weights':>10}" if wide else "") + f"{'cache ms':>10}{'eager ms':>10}"
          f"{'graph ms':>10}{'no-pdl ms':>10}{'floor ms':>10}{'graph/floor':>12}{'op floor':>10}{'graph/op':>9}"
          + (f"{'rel floor':>10}{'graph/rel':>10}" if wide else "") + f"{'cache/graph':>12}{'kernels':>9}"
          f"{'busy ms':>9}{'sampled ms':>11}{'sampled/graph':>14}")  # fmt: skip
    profiles = []
    for context in contexts:
        state = {w: _pool_and_graphs(d, heads, requests, context, sampling, device) for w, d in drafts.items()}
        for n in requests:
            slots = torch.arange(n, device=device)
            anchors = torch.randint(0, spec.vocab_size - 1, (n,), device=device)
            plan = StepPlan(step=0, ranks=(0,), counts=(n * B,))
            slot_list, anchor_list = slots.tolist(), anchors.tolist()
            with torch.no_grad():  # every draft's eager step, then its graph step, timed side by side
                eagers = time_alternately_ms([lambda d=d, pool=state[w][0]: d.step(pool, slots, anchors, heads, plan)
                                              for w, d in drafts.items()], args.steps, args.warmup)  # fmt: skip
                graphs_ms = time_alternately_ms([lambda g=state[w][1]: g.run(slot_list, anchor_list, plan)
                                                 for w in drafts], args.steps, args.warmup)  # fmt: skip
            for (w, draft), eager, graph in zip(drafts.items(), eagers, graphs_ms):
                pool, graphs, no_pdl_graphs = state[w]
                with torch.no_grad():
                    with launch.pdl_off():  # a PDL kernel's time would count its wait for the one before
                        kernels, busy_us, top = _profile(lambda: draft.step(pool, slots, anchors, heads, plan),
                                                         args.profile)  # fmt: skip
                    with launch.pdl_off():  # captured on its first run, inside the block
                        no_pdl = _time_ms(lambda: no_pdl_graphs.run(slot_list, anchor_list, plan), args.steps,
                                          args.warmup)  # fmt: skip
                    drafts_NK = draft.step(pool, slots, anchors, heads, plan).drafts_NK
                    same = torch.equal(graphs.run(slot_list, anchor_list, plan).drafts_NK, drafts_NK) and torch.equal(
                        no_pdl_graphs.run(slot_list, anchor_list, plan).drafts_NK, drafts_NK
                    )
                    sampled = greedy = None
                    if sampling is not None:
                        readout = Readout.of([sampling])
                        greedy, sampled = time_alternately_ms(
                            [lambda: graphs.run(slot_list, anchor_list, plan),
                             lambda: graphs.run(slot_list, anchor_list, plan, readout=readout)], args.steps,
                            args.warmup,
                        )  # fmt: skip
                        step = draft.step(pool, slots, anchors, heads, plan, readout=readout)
                        replay = graphs.run(slot_list, anchor_list, plan, readout=readout)
                        same &= torch.equal(replay.drafts_NK, step.drafts_NK) and torch.equal(replay.probs_NKV,
                                                                                              step.probs_NKV)
                    cache = None
                    if cache_path:
                        caches = _caches_from_pool(draft, pool, n, context)
                        cache = _time_ms(lambda: reference_step(draft, caches, anchors, heads, plan), args.steps,
                                         args.warmup)  # fmt: skip
                        del caches
                    touched = touched_experts(draft, lambda: draft.step(pool, slots, anchors, heads, plan))
                costs = step_costs(draft, heads, n, context, touched)
                floor_s, nbytes, flops = whole_floor_seconds(costs, bytes_per_s)
                floor = floor_s * 1e3
                op_floor = op_floor_seconds(costs, bytes_per_s) * 1e3
                # the release's bytes, whichever draft ran: the quantized twin holds the release's experts
                rel = None if released is None else floor_seconds(drafts["quantized"], heads, n, context, bytes_per_s,
                                                                  touched, released)[0] * 1e3  # fmt: skip
                row = dict(kind="step", preset=label, weights=w, requests=n, context=context, cache_ms=cache,
                           eager_ms=eager, graph_ms=graph, no_pdl_graph_ms=no_pdl, floor_ms=floor, op_floor_ms=op_floor,
                           bytes=nbytes,
                           flops=flops, **({"floor_released_ms": rel} if rel is not None else {}),
                           experts_touched=touched, kernels=kernels, busy_ms=busy_us / 1e3, sampled_graph_ms=sampled,
                           greedy_graph_ms_beside_sampled=greedy, sampling=sampling and msgspec.to_builtins(sampling),
                           graph_equals_eager=same, device=torch.cuda.get_device_name(), torch=torch.__version__)  # fmt: skip
                results.append(row)
                cache_text = f"{cache:>10.3f}" if cache is not None else f"{'-':>10}"
                ratio = f"{cache / graph:>12.1f}" if cache is not None else f"{'-':>12}"
                sampled_text = (f"{sampled:>11.3f}{sampled / greedy:>14.3f}" if sampled is not None
                                else f"{'-':>11}{'-':>14}")  # fmt: skip
                print(f"{n:>5}{context:>9}" + (f"{w:>10}" if wide else "") + f"{cache_text}{eager:>10.3f}"
                      f"{graph:>10.3f}{no_pdl:>10.3f}{floor:>10.3f}{graph / floor:>12.2f}{op_floor:>10.3f}"
                      f"{graph / op_floor:>9.2f}"
                      + (f"{rel:>10.3f}{graph / rel:>10.2f}" if wide else "") + f"{ratio}{kernels:>9}"
                      f"{busy_us / 1e3:>9.3f}{sampled_text}{'' if same else '  graph != eager'}")  # fmt: skip
                if args.profile:
                    profiles.append((n, context, busy_us, top))
        del state
        torch.cuda.empty_cache()
    print_profiles(profiles, "one eager step")
    if args.attention:
        results += _attention_table(spec, requests, contexts, args, device, bytes_per_s)
    emit(results, args, plt)
    return 0


def print_profiles(profiles: list[tuple[int, int, float, list]], what: str) -> None:
    """Each point's costliest kernels (`kernel_breakdown`'s top), after the table."""
    for n, context, busy_us, top in profiles:
        print(f"top kernels of {what}, N {n}, context {context} ({busy_us:.0f} µs of kernels):")
        for name, calls, us in top:
            print(f"{calls:>6} x {us / calls:>7.1f} µs = {us:>8.1f} µs  {name[:100]}")


def emit(results: list[dict], args: argparse.Namespace, plt, *, kind: str = "step", what: str = "draft step") -> None:
    """The JSON lines on stdout, appended to `--json`, and the `--plot` (when asked) of the rows of `kind`."""
    for row in results:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    if plt is not None:
        plot(plt, results, args.plot, kind=kind, what=what)


def _attention_table(
    spec, requests: list[int], contexts: list[int], args, device: torch.device, bytes_per_s: float
) -> list[dict]:
    """One layer's block attention, Triton kernel vs SDPA and flex_attention (on K/V already
    gathered) and SDPA with the gather a pool needs, against the K/V bytes it must read (its floor)."""
    import torch._dynamo

    from epdraft.kernels.step.attention import block_attention, block_attention_reference

    h, g, D, B = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.block_size
    print(f"block attention, one layer: h {h}, g {g}, D {D}, B {B}, bf16")
    print(f"{'N':>5}{'context':>9}{'triton us':>11}{'sdpa us':>10}{'flex us':>10}{'flex |dy|':>11}"
          f"{'sdpa+gather us':>16}{'floor us':>10}{'triton/floor':>14}")  # fmt: skip
    rows, reasons = [], set()
    # One static-shape compile of flex_attention per point: lift dynamo's recompile limit (8 per
    # function) for this table only, or the later points would silently run flex unfused.
    # (torch < 2.7 calls the limit cache_size_limit.)
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    with torch._dynamo.config.patch(**{limit: 8 + len(requests) * len(contexts)}):
        for context in contexts:
            for n in requests:
                k = torch.randn(n + 1, g, context + B, D, device=device, dtype=torch.bfloat16)
                v = torch.randn_like(k)
                q = torch.randn(n, h, B, D, device=device, dtype=torch.bfloat16)
                slots = torch.arange(n, device=device)
                lens = torch.full((n,), context + B, device=device)
                k_n, v_n = k[:n].contiguous(), v[:n].contiguous()
                mask = torch.ones(n, 1, B, context + B, dtype=torch.bool, device=device)
                sdpa = torch.nn.functional.scaled_dot_product_attention
                triton_us = 1e3 * _time_ms(lambda: block_attention(q, k, v, slots, lens), args.steps, args.warmup)
                sdpa_us = 1e3 * _time_ms(lambda: sdpa(q, k_n, v_n, attn_mask=mask, enable_gqa=True), args.steps,
                                         args.warmup)  # fmt: skip
                flex_us, flex_dy, reason = _flex_us(q, k_n, v_n, lens, args)
                gather_us = 1e3 * _time_ms(lambda: block_attention_reference(q, k, v, slots, lens), args.steps,
                                           args.warmup)  # fmt: skip
                kv_bytes = 2 * n * g * (context + B) * D * 2
                floor_us = kv_bytes / bytes_per_s * 1e6
                flex_text = f"{flex_us:>10.1f}" if flex_us is not None else f"{'-':>10}"
                dy_text = f"{flex_dy:>11.2e}" if flex_dy is not None else f"{'-':>11}"
                print(f"{n:>5}{context:>9}{triton_us:>11.1f}{sdpa_us:>10.1f}{flex_text}{dy_text}{gather_us:>16.1f}"
                      f"{floor_us:>10.1f}{triton_us / floor_us:>14.2f}")  # fmt: skip
                if reason is not None and reason not in reasons:
                    print(f"  flex: {reason}")
                    reasons.add(reason)
                rows.append(dict(kind="attention", requests=n, context=context, triton_us=triton_us, sdpa_us=sdpa_us,
                                 flex_us=flex_us, flex_max_abs_diff=flex_dy, flex_error=reason,
                                 sdpa_gather_us=gather_us, floor_us=floor_us, kv_bytes=kv_bytes))  # fmt: skip
                del k, v, k_n, v_n
    return rows


FLEX_MAX_ABS_DIFF = 2e-2  # bf16 output against the fp32 reference: the Triton kernel's bound in tests/gpu


def _flex_us(q_NhBD, k_NgSD, v_NgSD, lens_N, args) -> tuple[float | None, float | None, str | None]:
    """(µs, max |dy| against the fp32 reference, None), or (None, max |dy| or None, why not timed).

    flex_attention over gathered K/V [N, g, S, D] with a length mask_mod (keys [0, lens[n]) of
    request n), the contract of `block_attention_reference`; compiled with static shapes on the
    first call, checked against the reference before any timing.
    """
    from epdraft.kernels.step.attention import block_attention_reference

    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        return None, None, f"torch.nn.attention.flex_attention cannot be imported: {e}"
    N, h, B, _ = q_NhBD.shape
    S = k_NgSD.shape[2]

    def within_length(b, head, q_idx, kv_idx):
        return kv_idx < lens_N[b]

    try:
        block_mask = create_block_mask(within_length, B=N, H=None, Q_LEN=B, KV_LEN=S, device=q_NhBD.device)
        compiled = torch.compile(flex_attention, dynamic=False)

        def flex() -> torch.Tensor:
            return compiled(q_NhBD, k_NgSD, v_NgSD, block_mask=block_mask, enable_gqa=k_NgSD.shape[1] != h)

        out = flex()
    except RuntimeError as e:  # torch.compile's failures (no Triton, a kernel that does not build) are RuntimeErrors
        return None, None, f"flex_attention does not compile here: {_one_line(e)}"
    ref = block_attention_reference(q_NhBD.float(), k_NgSD.float(), v_NgSD.float(),
                                    torch.arange(N, device=q_NhBD.device), lens_N)  # fmt: skip
    dy = (out.float() - ref).abs().max().item()
    del ref
    if dy > FLEX_MAX_ABS_DIFF:
        return None, dy, f"flex_attention differs from the reference, max |dy| {dy:.3g} > {FLEX_MAX_ABS_DIFF}: not timed"
    return 1e3 * _time_ms(flex, args.steps, args.warmup), dy, None


def _one_line(e: BaseException, width: int = 200) -> str:
    """An exception as one line: its type and message, lines joined, cut to `width` characters."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    text = f"{type(e).__name__}: {text}"
    return text if len(text) <= width else text[: width - 3] + "..."


def _caches_from_pool(draft, pool, n: int, context: int):
    """DraftCaches holding the same context as pool slots [0, n) (for the cache-based step)."""
    from epdraft.models.reference import new_cache

    caches = [new_cache(draft) for _ in range(n)]
    for i, cache in enumerate(caches):
        for layer in range(draft.spec.num_layers):
            cache.append(layer, pool.k[layer][i, :, :context], pool.v[layer][i, :, :context])
        cache.length = context
    return caches
