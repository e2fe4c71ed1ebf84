"""The fused experts' tuner: candidate tiles, parallel compilation, CUDA-graph timing, the search.

`epdraft bench kernel --tune` drives it and writes what it finds with
`epdraft.kernels.experts.tables.save_table`; the kernels only ever read those tables. Measures on
the current CUDA device; imports Triton when it runs.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import msgspec
import torch

from epdraft.config.ffn import ActivationSpec
from epdraft.errors import ConfigError
from epdraft.kernels.experts.align import align_pairs
from epdraft.kernels.experts.fused import MXFP4_UPCAST, down_combine, up_act
from epdraft.kernels.experts.tables import DownConfig, MoeKernelConfig, UpConfig, fits_format
from epdraft.loading.quant import quantize_weights

log = logging.getLogger(__name__)

SMEM_BYTES = 200 * 1024  # H100/H200 allow 227 KB per block; leave room for Triton's own scratch


WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0, "mxfp4": 17 / 32}
"""Bytes a weight tile holds per element in shared memory, per weight format (bf16 also stands for
fp16 weights; MXFP4: half a byte + one e8m0 scale per 32)."""


def _smem_fits(block_m: int, block_n: int, block_k: int, stages: int, b_tiles: int, weights: str) -> bool:
    """Whether `stages` copies of the bf16 activation tile and `b_tiles` weight tiles fit, the
    weights at their stored bytes: quantized tiles are staged as stored, so they fit wider tiles."""
    per_stage = block_m * block_k * 2 + b_tiles * block_n * block_k * WEIGHT_BYTES[weights]
    return stages * per_stage <= SMEM_BYTES


def block_m_candidates(num_tokens: int, top_k: int, num_experts: int) -> list[int]:
    """The two largest block sizes up to twice the mean rows per expert (16 at least).

    Half-empty 64-row blocks still win once the GEMM is compute-bound: they use Hopper's wgmma.
    """
    mean_rows = num_tokens * top_k / num_experts
    sizes = [bm for bm in (16, 32, 64, 128) if bm == 16 or bm <= 2 * mean_rows]
    return sizes[-2:]


def _splits(rows: int, num_experts: int, reduction: int, block_k: int) -> tuple[int, ...]:
    """Split-K factors worth trying: only for short GEMMs (<= 64 rows per expert on average), each split >= 1 tile."""
    if rows > 64 * num_experts:
        return (1,)
    return tuple(sk for sk in (1, 2, 4) if sk * block_k <= reduction)


def _warps(block_n: int) -> tuple[int, ...]:
    """4 warps for narrow tiles, 8 for the widest, both in between."""
    return (4,) if block_n <= 64 else (8,) if block_n >= 256 else (4, 8)


def up_candidates(block_m: int, rows: int, num_experts: int, hidden: int, weights: str = "bf16") -> list[UpConfig]:
    """The widest tiles (64 x 256 and up) fit quantized weights only: MXFP4 decodes fastest in them
    (V4.1-Flash's experts at T = 16 on an H100: 65 -> 76 % of the copy rate)."""
    tiles = [(32, 128), (32, 256), (64, 64), (64, 128), (128, 64), (64, 256), (128, 128), (32, 512)]
    return [
        UpConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=s, split_k=sk)
        for bn, bk in tiles
        for w in _warps(bn)
        for s in (3, 4, 5)
        for sk in _splits(rows, num_experts, hidden, bk)
        if _smem_fits(block_m, bn, bk, s, 2, weights)
    ]


def down_candidates(
    block_m: int, rows: int, num_experts: int, intermediate: int, weights: str = "bf16"
) -> list[DownConfig]:
    """Narrow tiles and deep pipelines too: the short down GEMM needs many bytes in flight per SM."""
    tiles = [(32, 128), (32, 256), (64, 128), (64, 256), (128, 64), (128, 128), (256, 64), (128, 256), (64, 512)]
    return [
        DownConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=s, split_k=sk)
        for bn, bk in tiles
        for w in _warps(bn)
        for s in (3, 4, 5, 6)
        for sk in _splits(rows, num_experts, intermediate, bk)
        if _smem_fits(block_m, bn, bk, s, 1, weights)
    ]


_GROUP_M = (1, 4)  # program orders tried on the best tiles, besides 0 (every row block first)


def _compile_all(run: Callable[[object], object], candidates: list) -> list:
    """Compile every candidate at once on a thread pool (Triton's compiler releases the GIL); keep those that compile."""
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime.errors import OutOfResources

    device = torch.cuda.current_device()

    def attempt(cand):
        torch.cuda.set_device(device)
        try:
            run(cand)
        except OutOfResources:
            return None
        return cand

    first = attempt(candidates[0]) if candidates else None  # sets up Triton's per-device caches on one thread
    with ThreadPoolExecutor(max_workers=16) as pool:
        kept = [c for c in pool.map(attempt, candidates[1:]) if c is not None]
    kept = ([first] if first is not None else []) + kept
    torch.cuda.synchronize()
    return kept


def fastest(candidates: list, time_us: Callable[[object], float]) -> tuple[object, float]:
    """The candidate with the least time."""
    if not candidates:
        raise ConfigError("no candidate config compiled")
    timed = [(time_us(c), i) for i, c in enumerate(candidates)]
    best_us, best = min(timed)
    return candidates[best], best_us


def _best_order(config, time_us: Callable[[object], float], base_us: float):
    """`config` with the fastest program order among group_m = 0 (its own) and `_GROUP_M`, then
    with its weight tiles copied by TMA if that is faster."""
    best, best_us = config, base_us
    for cand in [msgspec.structs.replace(config, group_m=g) for g in _GROUP_M]:
        us = time_us(cand)
        if us < best_us:
            best, best_us = cand, us
    tma = msgspec.structs.replace(best, weight_tma=True)
    tma_us = time_us(tma)
    return (tma, tma_us) if tma_us < best_us else (best, best_us)


def _search(run: Callable[[object], object], candidates: list) -> tuple[object, float]:
    """The fastest of `candidates` for `run(config)` (compiled in parallel, timed as CUDA-graph
    replays), then with its best program order; returns it and its µs."""

    def time_us(config) -> float:
        return graph_us(lambda: run(config), rep_ms=20)

    best, best_us = fastest(_compile_all(run, candidates), time_us)
    return _best_order(best, time_us, best_us)


def graph_us(fn: Callable[[], object], rep_ms: int = 50) -> float:
    """Median µs of a CUDA-graph replay of `fn` (`triton.testing.do_bench`, which flushes L2 before each run).

    `fn` runs once eagerly first, on a side stream as capture needs, so compilation stays out.
    """
    from triton.testing import do_bench

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=10, rep=rep_ms, return_mode="median") * 1e3


def calls_us(fn: Callable[[int], object], calls: int, replays: int = 20) -> float:
    """Median µs of one call among `calls` back-to-back calls `fn(0) ... fn(calls - 1)` captured in
    one CUDA graph (no launch gaps, no L2 flush: callers cycle `i` over inputs larger than the L2, so
    each call reads from HBM as in a step). `fn(0)` runs eagerly first, so compilation stays out."""
    import statistics

    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def random_routing(
    num_tokens: int, num_experts: int, top_k: int, device: torch.device, generator=None, skew: float = 1.0
):
    """Distinct random experts per token and softmax weights: (ids_TK int64, weights_TK fp32).

    skew 1: uniform. skew < 1: expert popularity skew^rank over a random order of the experts, each
    token's experts drawn without replacement in proportion to it (Gumbel top-k), the way a draft
    step's near-identical mask rows crowd a few experts (issue 13's step at 8 requests routes
    ~78 / 54 / 35 / 29 / 21 / 17 / 13 / 9 of its 256 pairs: ~0.75).
    """
    scores = torch.rand(num_tokens, num_experts, device=device, generator=generator)
    if skew != 1.0:
        rank = torch.randperm(num_experts, device=device, generator=generator)
        scores = rank * math.log(skew) - torch.log(-torch.log(scores.clamp_min(1e-12)))
    ids_TK = scores.topk(top_k, dim=-1).indices
    weights_TK = torch.softmax(torch.randn(num_tokens, top_k, device=device, generator=generator), dim=-1)
    return ids_TK, weights_TK


def tune(
    num_experts: int,
    intermediate: int,
    hidden: int,
    top_k: int,
    dtype: torch.dtype,
    tokens: list[int],
    weights: str = "bf16",
    mxfp4_upcast: str | None = None,
    mxfp4_packing: str = "nibbles",
    skew: float = 1.0,
) -> dict[int, MoeKernelConfig]:
    """Search block rows, then the up and down GEMMs apart (they do not interact), per token count.

    Returns the table keyed by row count M = T * top_k. Per block size, every candidate's tiles,
    warps, stages and split-K are compiled in parallel, then timed on random routing on the current
    CUDA device; the best tiles then try the other program orders and TMA weight copies. Times are CUDA-graph replays
    (`graph_us`), as the forward runs in a server, so launch gaps and split-K's counter reset count
    as they will there. The fastest up + down pair over block sizes wins. `weights` fp8 | mxfp4
    tunes the quantized kernels on random weights quantized by `epdraft.loading.quant`
    (fp8 with 128 x 128 blocks), among the candidates they can run; MXFP4 through `mxfp4_upcast`
    (default: the kernels' `MXFP4_UPCAST`), its bytes `shift_packed` when `mxfp4_packing` is "shift".
    skew: the routing's (`random_routing`): tiles for a step whose rows crowd a few experts.
    """
    mxfp4_upcast = mxfp4_upcast or MXFP4_UPCAST

    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, device=device, generator=gen) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, intermediate, device=device, generator=gen) * intermediate**-0.5).to(dtype)
    w13, w2 = quantize_weights(w13, weights), quantize_weights(w2, weights)
    if mxfp4_packing == "shift":
        w13, w2 = w13.shift_packed(), w2.shift_packed()
    act = ActivationSpec()

    table: dict[int, MoeKernelConfig] = {}
    for num_tokens in tokens:
        rows = num_tokens * top_k
        x = torch.randn(num_tokens, hidden, device=device, generator=gen).to(dtype)
        ids, topk_w = random_routing(num_tokens, num_experts, top_k, device, gen, skew)
        best_us = float("inf")
        for block_m in block_m_candidates(num_tokens, top_k, num_experts):
            aligned = align_pairs(ids.view(-1), num_experts, block_m)
            ups = [c for c in up_candidates(block_m, rows, num_experts, hidden, weights)
                   if fits_format(c, weights, hidden)]
            up, up_time = _search(lambda c: up_act(x, aligned, w13, None, act, c, mxfp4_upcast), ups)
            h = up_act(x, aligned, w13, None, act, up, mxfp4_upcast)
            downs = [c for c in down_candidates(block_m, rows, num_experts, intermediate, weights)
                     if fits_format(c, weights, intermediate)]
            down, down_time = _search(lambda c: down_combine(h, aligned, ids, topk_w, w2, None, c, mxfp4_upcast),
                                      downs)
            log.info("T=%d block_m=%d: up %.1f us %s, down %.1f us %s", num_tokens, block_m, up_time, up, down_time, down)
            if up_time + down_time < best_us:
                best_us = up_time + down_time
                table[rows] = MoeKernelConfig(block_m=block_m, up=up, down=down)
    return table
