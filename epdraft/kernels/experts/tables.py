"""Launch configs of the fused experts: per-shape JSON tables, their lookup and the default.

A table is one file per (E, N, K, dtype, device) in `epdraft/kernels/experts/configs/`, named like
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
from typing import Annotated

import msgspec
import torch

from epdraft.errors import ConfigError

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).parent / "configs"
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}

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
