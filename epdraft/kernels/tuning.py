"""Launch configs of the fused experts: per-shape JSON tables, the default, and the tuner.

A table is one file per (E, N, K, dtype, device) in `epdraft/kernels/configs/`, named like
`E=8,N=3072,K=4096,dtype=bf16,device=NVIDIA_H200.json` (N = 2F rows of w13, K = H), mapping a
row count M = T * top_k (token-expert pairs: the rows the GEMMs see, so one table serves every
top-k of the shape) to a `MoeKernelConfig`; a lookup takes the entry of the nearest M. Without a
file the documented default runs and one warning names the missing file: the speed differs, the
output does not. Tables are Triton-version specific; re-tune after upgrading Triton. Quantized
weights have tables of their own (`...,dtype=bf16,weights=mxfp4,device=...json`): they move other
bytes per tile, so other tiles win.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Annotated, Callable

import msgspec
import torch

from epdraft.errors import ConfigError

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).parent / "configs"
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_SMEM_BYTES = 200 * 1024  # H100/H200 allow 227 KB per block; leave room for Triton's own scratch

Pow2 = Annotated[int, msgspec.Meta(ge=16, le=512)]


class GemmConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Tiles and program order of one grouped GEMM.

    split_k > 1 splits the reduction across programs; their fp32 partials are summed in split order.
    group_m is how many row blocks programs walk down one column tile before the next (0: all of
    them, so an expert's blocks share its weight tile in L2; 1: along each row block). weight_tma
    copies each weight tile with one TMA instruction instead of a 16-byte load per thread (a third
    fewer instructions in the bf16 main loops; on the H200 mostly within 3 % of the per-thread
    loads, docs/performance.md), where the weights allow it (`tl.dot_scaled`'s MXFP4 and misaligned weights keep the per-thread loads).
    """

    block_n: Pow2
    block_k: Pow2
    num_warps: Annotated[int, msgspec.Meta(ge=1, le=16)] = 4
    num_stages: Annotated[int, msgspec.Meta(ge=1, le=8)] = 3
    split_k: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1
    group_m: Annotated[int, msgspec.Meta(ge=0)] = 0
    weight_tma: bool = False


class UpConfig(GemmConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The gate/up GEMM (+ activation). block_n counts gate columns; up columns match."""


class DownConfig(GemmConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The down GEMM (+ routing weight); split partials are summed with each token's top-k."""


class MoeKernelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One launch config: rows per block (shared by routing setup and both GEMMs) and each GEMM's tiles."""

    block_m: Pow2
    up: UpConfig
    down: DownConfig


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        raise ConfigError(f"fused experts support bf16 and fp16, got {dtype}")
    return _DTYPE_NAMES[dtype]


def config_file_name(
    num_experts: int, n: int, k: int, dtype: torch.dtype, device_name: str, weights: str = "bf16"
) -> str:
    """File name of the table for experts w13 [num_experts, n, k] in `dtype` (stored as `weights`) on `device_name`."""
    device = device_name.replace(" ", "_")
    stored = "" if weights == "bf16" else f",weights={weights}"
    return f"E={num_experts},N={n},K={k},dtype={dtype_name(dtype)}{stored},device={device}.json"


def fits_format(gemm: GemmConfig, weights: str, reduction: int, scale_cols: int = 128) -> bool:
    """Whether the quantized kernels can run `gemm` over a reduction of `reduction` (H or F).

    Quantized tiles need whole K tiles (no masking: K % (block_k * split_k) == 0); FP8 tiles must
    not straddle a scale block (scale_cols % block_k == 0); MXFP4 dot_scaled tiles hold >= 2 groups.
    """
    if weights == "bf16":
        return True
    if reduction % (gemm.block_k * gemm.split_k):
        return False
    if weights == "fp8":
        return scale_cols % gemm.block_k == 0
    return gemm.block_k >= 64


def fit_format(
    config: MoeKernelConfig, weights: str, scale_cols: int, hidden: int, intermediate: int
) -> MoeKernelConfig:
    """`config`, with each GEMM's block_k (and split_k) cut down until the quantized kernels can run it
    (FP8: block_k first, to fit a scale block; then split_k, then block_k, to divide the reduction).

    Raises ConfigError when no block_k >= 64 divides the reduction (the formats' shapes always allow one).
    """
    def fit(gemm, reduction):
        while not fits_format(gemm, weights, reduction, scale_cols):
            if weights == "fp8" and scale_cols % gemm.block_k and gemm.block_k > 64:
                gemm = msgspec.structs.replace(gemm, block_k=gemm.block_k // 2)
            elif gemm.split_k > 1:
                gemm = msgspec.structs.replace(gemm, split_k=gemm.split_k // 2)
            elif gemm.block_k > 64:
                gemm = msgspec.structs.replace(gemm, block_k=gemm.block_k // 2)
            else:
                raise ConfigError(f"{weights} experts: reduction {reduction} is not a multiple of 64 "
                                  f"(scale block columns {scale_cols}); the quantized kernels need whole K tiles")
        return gemm

    return msgspec.structs.replace(config, up=fit(config.up, hidden), down=fit(config.down, intermediate))


def default_config(num_tokens: int, top_k: int, num_experts: int) -> MoeKernelConfig:
    """The config used without a table: block rows near the mean rows per expert, mid-size tiles.

    Small batches stream weights (memory-bound): narrow N tiles give more programs than SMs.
    """
    rows_per_expert = num_tokens * top_k / max(num_experts, 1)
    if rows_per_expert <= 16:
        return MoeKernelConfig(
            block_m=16,
            up=UpConfig(block_n=32, block_k=256, num_warps=4, num_stages=4),
            down=DownConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=1),
        )
    if rows_per_expert <= 64:
        return MoeKernelConfig(
            block_m=32,
            up=UpConfig(block_n=64, block_k=128, num_warps=4, num_stages=4),
            down=DownConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=1),
        )
    return MoeKernelConfig(
        block_m=64,
        up=UpConfig(block_n=64, block_k=64, num_warps=4, num_stages=4),
        down=DownConfig(block_n=128, block_k=64, num_warps=4, num_stages=4, split_k=1),
    )


@functools.lru_cache(maxsize=None)
def load_table(path: Path) -> dict[int, MoeKernelConfig] | None:
    """Read one table (cached); None if the file is missing; ConfigError if malformed."""
    if not path.is_file():
        return None
    try:
        table = msgspec.json.decode(path.read_bytes(), type=dict[int, MoeKernelConfig])
    except msgspec.ValidationError as e:
        raise ConfigError(f"{path}: {e}") from e
    except msgspec.DecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    if not table:
        raise ConfigError(f"{path}: empty table, expected token counts mapped to configs")
    return table


def get_config(
    num_experts: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    num_tokens: int,
    top_k: int,
    device_name: str,
    config_dir: Path = CONFIG_DIR,
    weights: str = "bf16",
) -> MoeKernelConfig:
    """Config of the nearest tuned row count M = T * top_k (ties: the smaller); the default without a table.

    Quantized `weights` take their own table up to twice its largest tuned M, and the shape's bf16
    table past that or without one (its tiles suit the shape; `fit_format` then makes them
    runnable): on the H200, fp8 and mxfp4 tables tuned at T <= 512 ran T = 2048 1.5x slower on their
    T = 512 tiles than on the bf16 table's T = 2048 ones (docs/gpu-results.md, sixth session run 2).
    A missing table is named in one warning, with what is used instead.
    """
    rows = num_tokens * top_k
    bf16_path = config_dir / config_file_name(num_experts, n, k, dtype, device_name)
    table = None
    if weights != "bf16":
        own_path = config_dir / config_file_name(num_experts, n, k, dtype, device_name, weights)
        table = load_table(own_path)
        if table is None:
            _warn_missing(own_path, "the shape's bf16 table" if load_table(bf16_path) else "the default config")
        elif rows > 2 * max(table):
            table = load_table(bf16_path) or table
    if table is None:
        table = load_table(bf16_path)
        if table is None:
            _warn_missing(bf16_path, "the default config")
            return default_config(num_tokens, top_k, num_experts)
    return table[min(table, key=lambda m: (abs(m - rows), m))]


@functools.lru_cache(maxsize=None)
def _warn_missing(path: Path, instead: str) -> None:
    log.warning("no tuned fused-experts config %s: using %s (slower, same output)", path, instead)


def save_table(table: dict[int, MoeKernelConfig], path: Path) -> None:
    """Merge `table` into the file at `path` (new entries win), written sorted and indented (diffable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    merged = {**(load_table(path) or {}), **table} if path.is_file() else table
    ordered = {str(m): merged[m] for m in sorted(merged)}
    path.write_bytes(msgspec.json.format(msgspec.json.encode(ordered), indent=2) + b"\n")
    load_table.cache_clear()


def _smem_fits(block_m: int, block_n: int, block_k: int, stages: int, b_tiles: int) -> bool:
    return stages * (block_m * block_k + b_tiles * block_n * block_k) * 2 <= _SMEM_BYTES


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


def up_candidates(block_m: int, rows: int, num_experts: int, hidden: int) -> list[UpConfig]:
    tiles = [(32, 128), (32, 256), (64, 64), (64, 128), (128, 64)]
    return [
        UpConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=s, split_k=sk)
        for bn, bk in tiles
        for w in _warps(bn)
        for s in (3, 4, 5)
        for sk in _splits(rows, num_experts, hidden, bk)
        if _smem_fits(block_m, bn, bk, s, 2)
    ]


def down_candidates(block_m: int, rows: int, num_experts: int, intermediate: int) -> list[DownConfig]:
    """Narrow tiles and deep pipelines too: the short down GEMM needs many bytes in flight per SM."""
    tiles = [(32, 128), (32, 256), (64, 128), (64, 256), (128, 64), (128, 128), (256, 64)]
    return [
        DownConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=s, split_k=sk)
        for bn, bk in tiles
        for w in _warps(bn)
        for s in (3, 4, 5, 6)
        for sk in _splits(rows, num_experts, intermediate, bk)
        if _smem_fits(block_m, bn, bk, s, 1)
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


def random_routing(num_tokens: int, num_experts: int, top_k: int, device: torch.device, generator=None):
    """Distinct uniformly random experts per token and softmax weights: (ids_TK int64, weights_TK fp32)."""
    scores = torch.rand(num_tokens, num_experts, device=device, generator=generator)
    ids_TK = scores.topk(top_k, dim=-1).indices
    weights_TK = torch.softmax(torch.randn(num_tokens, top_k, device=device, generator=generator), dim=-1)
    return ids_TK, weights_TK


def quantize_weights(w: torch.Tensor, weights: str):
    """`w` [e, N, K] as `ExpertWeights` in format `weights` (fp8: 128 x 128 blocks), by epdraft's quantizers."""
    from epdraft.kernels.weights import ExpertWeights
    from epdraft.loading.quant import quantize_fp8, quantize_mxfp4

    if weights == "bf16":
        return ExpertWeights(w)
    # one expert at a time: the quantizers' fp32 temporaries of a whole C/D weight would not fit
    if weights == "fp8":
        parts = [quantize_fp8(w[i], (128, 128)) for i in range(w.shape[0])]
        return ExpertWeights(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), "fp8", (128, 128))
    parts = [quantize_mxfp4(w[i]) for i in range(w.shape[0])]
    blocks = torch.stack([p[0] for p in parts])
    e, N, G, _ = blocks.shape
    return ExpertWeights(blocks.reshape(e, N, G * 16), torch.stack([p[1] for p in parts]), "mxfp4")


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
    """
    from epdraft.config.ffn import ActivationSpec
    from epdraft.kernels.align import align_pairs
    from epdraft.kernels.fused_moe import MXFP4_UPCAST, down_combine, up_act

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
        ids, topk_w = random_routing(num_tokens, num_experts, top_k, device, gen)
        best_us = float("inf")
        for block_m in block_m_candidates(num_tokens, top_k, num_experts):
            aligned = align_pairs(ids.view(-1), num_experts, block_m)
            ups = [c for c in up_candidates(block_m, rows, num_experts, hidden) if fits_format(c, weights, hidden)]
            up, up_time = _search(lambda c: up_act(x, aligned, w13, None, act, c, mxfp4_upcast), ups)
            h = up_act(x, aligned, w13, None, act, up, mxfp4_upcast)
            downs = [c for c in down_candidates(block_m, rows, num_experts, intermediate)
                     if fits_format(c, weights, intermediate)]
            down, down_time = _search(lambda c: down_combine(h, aligned, ids, topk_w, w2, None, c, mxfp4_upcast),
                                      downs)
            log.info("T=%d block_m=%d: up %.1f us %s, down %.1f us %s", num_tokens, block_m, up_time, up, down_time, down)
            if up_time + down_time < best_us:
                best_us = up_time + down_time
                table[rows] = MoeKernelConfig(block_m=block_m, up=up, down=down)
    return table
