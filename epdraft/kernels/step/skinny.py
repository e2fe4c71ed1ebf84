"""Dense projections of a draft step (few rows, large weights) as memory-bound Triton launches.

At 16 rows cuBLAS picks split-K GEMMs plus a reduce kernel per projection and reads the weights
at ~40-60 % of HBM bandwidth (docs/performance.md). Here one program owns a BLOCK_N slice of
output columns over a slice of K and every row, so each weight is read once, the splits are summed
by the tile's last program in the same launch, and the q/k/v projections (or a shared expert's
gate/up pair with its activation) share one launch. Callers use `fits` to choose these over
`torch.nn.functional.linear`, which stays the path for everything else.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

from epdraft.errors import ConfigError
from epdraft.kernels import launch
from epdraft.kernels.launch import next_pow2

log = logging.getLogger(__name__)

KERNEL_ROWS = 128  # one BLOCK_M = next_pow2(rows) tile holds every row
MAX_ROWS = 32  # `fits`: at 128 rows cuBLAS was 1.2-2.4x faster than these tiles on the H200, at 16 up to 1.7x slower
_DTYPES = (torch.bfloat16, torch.float16)
# (BLOCK_N, BLOCK_K, num_warps, num_stages) per kind of GPU, each measured there (tools/skinny_tune.py's
# step mix, then the step and the commit side by side). On an H100 the mix's best, (32, 256, 4, 4),
# summed 56.2 µs over issue13's projections at 16 rows against this config's 61.5, but in `bench
# iteration` at N = 1 the step ran no faster and the commit 12 µs slower: the H100 keeps the H200's config.
DEVICE_CONFIGS: dict[str, tuple[int, int, int, int]] = {"H200": (32, 128, 4, 5)}
DEFAULT_CONFIG = DEVICE_CONFIGS["H200"]  # on a GPU none was measured on
# what the pipelined tiles are held to: Triton's buffers for a config took up to ~1.8x this count
# of the stages' x and weight tiles on the H200, which has 227 KiB per SM
_SMEM_BYTES = 96 * 1024
# programs a launch aims at per SM when it splits K: a tile config's 60-100 KiB of pipelined
# tiles lets two or three stream from one SM at once
_PROGRAMS_PER_SM = 3
_MAX_SPLIT = 8
# weight bytes per row a program prefetches into L2 before it waits for the previous kernel
# (PDL): ~2-3 µs of HBM time over a whole projection, what the previous kernel and the launch leave idle
_PREFETCH_BYTES = 2048
_MAX_TILES = 1 << 16  # split tiles' arrival counts per device (a 2M-wide projection at BLOCK_N 32)


def _launch_config(config: tuple, block_m: int, weight_tiles: int) -> tuple[int, int, int, int]:
    """`config` with BLOCK_K halved until the stages' x and weight tiles fit the shared memory."""
    block_n, block_k, warps, stages = config
    while block_k > 32 and (block_m + weight_tiles * block_n) * block_k * 2 * stages > _SMEM_BYTES:
        block_k //= 2
    return block_n, block_k, warps, stages


def unsupported_reason(device_type: str, dtype: torch.dtype) -> str | None:
    """Why the skinny launches cannot run on `device_type` in `dtype`, or None."""
    if (why := launch.unsupported_reason(device_type)) is not None:
        return why
    if dtype not in _DTYPES:
        return f"the skinny projections take bfloat16/float16, the draft is {str(dtype).removeprefix('torch.')}"
    return None


def _takes(x_TK: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """What the launches can compute: CUDA, bf16/fp16, 1..KERNEL_ROWS rows, weights [N, K] of x's
    dtype, unit-stride rows."""
    return (
        x_TK.is_cuda
        and x_TK.dtype in _DTYPES
        and x_TK.dim() == 2
        and 0 < x_TK.shape[0] <= KERNEL_ROWS
        and x_TK.stride(1) == 1
        and all(w.dtype == x_TK.dtype and w.stride(1) == 1 and w.shape[1] == x_TK.shape[1] for w in weights)
    )


def fits(x_TK: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """Whether `linear` / `gate_up_act` beat nn.Linear on these shapes: x [T, K] with 1..MAX_ROWS
    rows (above, cuBLAS wins), weights [N, K] of x's dtype, unit-stride rows. The caller has
    resolved that the launches run here at all (`unsupported_reason`)."""
    return (
        x_TK.dim() == 2
        and 0 < x_TK.shape[0] <= MAX_ROWS
        and x_TK.stride(1) == 1
        and all(w.dtype == x_TK.dtype and w.stride(1) == 1 and w.shape[1] == x_TK.shape[1] for w in weights)
    )


@functools.lru_cache(maxsize=None)
def _device_config(device: torch.device) -> tuple[int, int, int, int]:
    """The config measured on this kind of GPU; DEFAULT_CONFIG, with one warning, on any other."""
    device_name = torch.cuda.get_device_name(device)
    for kind, config in DEVICE_CONFIGS.items():
        if kind in device_name:
            return config
    log.warning("skinny projections: no tile config measured on %s; using the H200's %s (speed differs, output "
                "does not; tools/skinny_tune.py measures one)", device_name, DEFAULT_CONFIG)  # fmt: skip
    return DEFAULT_CONFIG


def _checked(x_TK: torch.Tensor, weights: Sequence[torch.Tensor], config: tuple | None) -> tuple:
    """The launch config, after ConfigError for inputs the launches cannot take (1-3 weights) or
    that need gradients (the launches have no backward)."""
    launch.refuse_autograd("skinny projection", x_TK)
    if not 1 <= len(weights) <= 3 or not _takes(x_TK, weights):
        raise ConfigError(
            f"skinny: x {tuple(x_TK.shape)} {x_TK.dtype} on {x_TK.device} with weights "
            f"{[tuple(w.shape) for w in weights]}: needs 1-3 weights [N, K] of x's dtype, CUDA, 1-{KERNEL_ROWS} "
            "rows with unit-stride rows"
        )
    return config if config is not None else _device_config(x_TK.device)


def linear(
    x_TK: torch.Tensor, weights: Sequence[torch.Tensor], config: tuple | None = None, split_k: int | None = None
) -> torch.Tensor:
    """x @ [w0; w1; w2]^T as [T, sum N_i] in x's dtype (fp32 accumulation), 1-3 weights [N_i, K]
    in one launch: what `torch.cat([F.linear(x, w) for w in weights], 1)` computes, to rounding order.
    `config` (BLOCK_N, BLOCK_K, num_warps, num_stages) and `split_k` (K slices): the tuner's;
    default the device's config and `choose_split`."""
    return _linear(x_TK, weights, _checked(x_TK, weights, config), split_k)


def _linear(x_TK: torch.Tensor, weights: Sequence[torch.Tensor], config: tuple, split_k: int | None = None) -> torch.Tensor:
    """`linear`'s launch, unchecked (what Triton's CPU interpreter runs in development: fp32 on CPU)."""
    from epdraft.kernels.step._skinny_triton import skinny_linear_kernel

    T, K = x_TK.shape
    block_m = max(16, next_pow2(T))
    block_n, block_k, warps, stages = _launch_config(config, block_m, 1)
    ws = list(weights) + [weights[0]] * (3 - len(weights))
    ns = [w.shape[0] for w in weights] + [0] * (3 - len(weights))
    out = torch.empty(T, sum(ns), dtype=x_TK.dtype, device=x_TK.device)
    tiles = sum(-(-n // block_n) for n in ns)
    split = split_k or choose_split(tiles, K, block_k, x_TK.device)
    part, arrived = _split_buffers(split, T, sum(ns), tiles, out)
    skinny_linear_kernel[(tiles * split,)](
        x_TK, *ws, out, part, arrived, T, *ns, K, x_TK.stride(0), *(w.stride(0) for w in ws), out.stride(0),
        part.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
        PREFETCH=_prefetch_bytes(ws, K, block_k, split), num_warps=warps, num_stages=stages, **launch.kwargs(x_TK.device),
    )  # fmt: skip
    return out


def choose_split(tiles: int, K: int, block_k: int, device: torch.device) -> int:
    """K splits of a launch of `tiles` column tiles: 1 when the tiles alone give most SMs a program
    (> 3/4 of them); else the largest power of two up to _MAX_SPLIT that keeps tiles x split <=
    _PROGRAMS_PER_SM per SM and every split >= 2 BLOCK_K tiles. On the H200 (`tools/skinny_tune.py
    --splits`, 16-32 rows) splitting paid only for the narrow gate/up pairs (48-72 tiles: 16.4 ->
    12.8 µs at 4096 x 1536) and cost up to 40 % on the 128-192-tile projections."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    if 4 * tiles > 3 * sms:
        return 1
    split = 1
    while (split * 2 <= _MAX_SPLIT and tiles * split * 2 <= _PROGRAMS_PER_SM * sms
           and -(-K // block_k) >= 4 * split):  # fmt: skip
        split *= 2
    return split


def _split_buffers(split: int, T: int, width: int, tiles: int, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partials [split, T, width], the device's arrival counts): what a split launch reads;
    `out` for both when split == 1 (the kernel reads neither).

    The counts are one zeroed int32 per tile, shared by the skinny launches of one stream
    (`launch.zeroed_counts`: the commit's K/V projections on `launch.Fork`'s second stream count
    apart from those on the main one).
    """
    if split == 1:
        return out, out
    if tiles > _MAX_TILES:
        raise ConfigError(f"skinny: {tiles} column tiles split over K exceed the {_MAX_TILES} arrival counts")
    counts = launch.zeroed_counts("skinny", out.device, _MAX_TILES)
    return torch.empty(split, T, width, dtype=torch.float32, device=out.device), counts


def _prefetch_bytes(weights: Sequence[torch.Tensor], K: int, block_k: int, split: int) -> int:
    """Bytes of each weight row's K slice a program prefetches (PDL): _PREFETCH_BYTES over the
    splits, within the shortest slice, in 16-byte units; 0 when a row or the base is not 16-byte
    aligned (the bulk prefetch faults on those)."""
    size = weights[0].element_size()
    per_split = -(-(-(-K // block_k)) // split) * block_k
    shortest = K - (split - 1) * per_split
    aligned = all(w.data_ptr() % 16 == 0 and (w.stride(0) * size) % 16 == 0 for w in weights)
    nbytes = min(_PREFETCH_BYTES // split, shortest * size) // 16 * 16
    return nbytes if aligned and nbytes > 0 else 0


def gate_up_act(
    x_TK: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, swiglu: bool, limit: float, alpha: float,
    config: tuple | None = None, split_k: int | None = None,
) -> torch.Tensor:
    """act(x @ w_gate^T, x @ w_up^T) [T, I] in x's dtype, in one launch: `gated_act(F.linear(x,
    w_gate), F.linear(x, w_up), act).to(x.dtype)` (swiglu, or swigluoai with alpha; limit > 0
    clamps); `config`, `split_k` as in `linear`."""
    config = _checked(x_TK, [w_gate, w_up], config)
    if w_gate.shape != w_up.shape:
        raise ConfigError(f"skinny.gate_up_act: gate {tuple(w_gate.shape)} and up {tuple(w_up.shape)} must match")
    return _gate_up_act(x_TK, w_gate, w_up, swiglu, limit, alpha, config, split_k)


def _gate_up_act(
    x_TK: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, swiglu: bool, limit: float, alpha: float, config: tuple,
    split_k: int | None = None,
) -> torch.Tensor:
    """`gate_up_act`'s launch, unchecked (as `_linear`)."""
    from epdraft.kernels.step._skinny_triton import skinny_gate_up_kernel

    T, K = x_TK.shape
    block_m = max(16, next_pow2(T))
    block_n, block_k, warps, stages = _launch_config(config, block_m, 2)
    I = w_gate.shape[0]
    out = torch.empty(T, I, dtype=x_TK.dtype, device=x_TK.device)
    tiles = -(-I // block_n)
    split = split_k or choose_split(tiles, K, block_k, x_TK.device)
    part, arrived = _split_buffers(split, T, 2 * I, tiles, out)
    skinny_gate_up_kernel[(tiles * split,)](
        x_TK, w_gate, w_up, out, part, arrived, T, I, K, x_TK.stride(0), w_gate.stride(0), w_up.stride(0),
        out.stride(0), part.stride(0), limit, alpha, SWIGLU=swiglu, HAS_LIMIT=limit > 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
        PREFETCH=_prefetch_bytes([w_gate, w_up], K, block_k, split), num_warps=warps, num_stages=stages,
        **launch.kwargs(x_TK.device),
    )  # fmt: skip
    return out
