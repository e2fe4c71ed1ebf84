"""Dense projections of a draft step (few rows, large weights) as memory-bound Triton launches.

At 16 rows cuBLAS picks split-K GEMMs plus a reduce kernel per projection and reads the weights
at ~40-60 % of HBM bandwidth (docs/performance.md). Here one program owns a BLOCK_N slice of
output columns over all of K and every row, so each weight is read once, and the q/k/v projections
(or a shared expert's gate/up pair with its activation) share one launch. Callers use
`fits` to choose these over `torch.nn.functional.linear`, which stays the path for everything else.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

from epdraft.errors import ConfigError
from epdraft.kernels.align import next_pow2

log = logging.getLogger(__name__)

KERNEL_ROWS = 128  # one BLOCK_M = next_pow2(rows) tile holds every row
MAX_ROWS = 32  # `fits`: at 128 rows cuBLAS was 1.2-2.4x faster than these tiles on the H200, at 16 up to 1.7x slower
_DTYPES = (torch.bfloat16, torch.float16)
# (BLOCK_N, BLOCK_K, num_warps, num_stages): measured on the H200 (tools/skinny_tune.py)
DEFAULT_CONFIG = (32, 128, 4, 5)
# what the pipelined tiles are held to: Triton's buffers for a config took up to ~1.8x this count
# of the stages' x and weight tiles on the H200, which has 227 KiB per SM
_SMEM_BYTES = 96 * 1024


def _launch_config(config: tuple, block_m: int, weight_tiles: int) -> tuple[int, int, int, int]:
    """`config` with BLOCK_K halved until the stages' x and weight tiles fit the shared memory."""
    block_n, block_k, warps, stages = config
    while block_k > 32 and (block_m + weight_tiles * block_n) * block_k * 2 * stages > _SMEM_BYTES:
        block_k //= 2
    return block_n, block_k, warps, stages


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
    """Whether a caller should take `linear` / `gate_up_act` over nn.Linear: the launches can
    compute it, at most MAX_ROWS rows (where they beat cuBLAS), outside autograd (no backward)."""
    return _takes(x_TK, weights) and x_TK.shape[0] <= MAX_ROWS and not torch.is_grad_enabled()


@functools.lru_cache(maxsize=None)
def _device_config(device: torch.device) -> tuple[int, int, int, int]:
    """DEFAULT_CONFIG, with one warning per device that it was measured on another GPU."""
    device_name = torch.cuda.get_device_name(device)
    if "H200" not in device_name:
        log.warning("skinny projections: no tile config measured on %s; using the H200's %s (speed differs, output "
                    "does not; tools/skinny_tune.py measures one)", device_name, DEFAULT_CONFIG)  # fmt: skip
    return DEFAULT_CONFIG


def _checked(x_TK: torch.Tensor, weights: Sequence[torch.Tensor], config: tuple | None) -> tuple:
    """The launch config, after ConfigError for inputs the launches cannot take (1-3 weights)."""
    if not 1 <= len(weights) <= 3 or not _takes(x_TK, weights):
        raise ConfigError(
            f"skinny: x {tuple(x_TK.shape)} {x_TK.dtype} on {x_TK.device} with weights "
            f"{[tuple(w.shape) for w in weights]}: needs 1-3 weights [N, K] of x's dtype, CUDA, 1-{KERNEL_ROWS} "
            "rows with unit-stride rows"
        )
    return config if config is not None else _device_config(x_TK.device)


def linear(x_TK: torch.Tensor, weights: Sequence[torch.Tensor], config: tuple | None = None) -> torch.Tensor:
    """x @ [w0; w1; w2]^T as [T, sum N_i] in x's dtype (fp32 accumulation), 1-3 weights [N_i, K]
    in one launch: what `torch.cat([F.linear(x, w) for w in weights], 1)` computes, to rounding order.
    `config` (BLOCK_N, BLOCK_K, num_warps, num_stages): the tuner's; default the device's."""
    return _linear(x_TK, weights, _checked(x_TK, weights, config))


def _linear(x_TK: torch.Tensor, weights: Sequence[torch.Tensor], config: tuple) -> torch.Tensor:
    """`linear`'s launch, unchecked (what Triton's CPU interpreter runs in development: fp32 on CPU)."""
    from epdraft.kernels._skinny_triton import skinny_linear_kernel

    T, K = x_TK.shape
    block_m = max(16, next_pow2(T))
    block_n, block_k, warps, stages = _launch_config(config, block_m, 1)
    ws = list(weights) + [weights[0]] * (3 - len(weights))
    ns = [w.shape[0] for w in weights] + [0] * (3 - len(weights))
    out = torch.empty(T, sum(ns), dtype=x_TK.dtype, device=x_TK.device)
    grid = (sum(-(-n // block_n) for n in ns),)
    skinny_linear_kernel[grid](
        x_TK, *ws, out, T, *ns, K, x_TK.stride(0), *(w.stride(0) for w in ws), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def gate_up_act(
    x_TK: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, swiglu: bool, limit: float, alpha: float,
    config: tuple | None = None,
) -> torch.Tensor:
    """act(x @ w_gate^T, x @ w_up^T) [T, I] in x's dtype, in one launch: `gated_act(F.linear(x,
    w_gate), F.linear(x, w_up), act).to(x.dtype)` (swiglu, or swigluoai with alpha; limit > 0 clamps)."""
    config = _checked(x_TK, [w_gate, w_up], config)
    if w_gate.shape != w_up.shape:
        raise ConfigError(f"skinny.gate_up_act: gate {tuple(w_gate.shape)} and up {tuple(w_up.shape)} must match")
    return _gate_up_act(x_TK, w_gate, w_up, swiglu, limit, alpha, config)


def _gate_up_act(
    x_TK: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, swiglu: bool, limit: float, alpha: float, config: tuple
) -> torch.Tensor:
    """`gate_up_act`'s launch, unchecked (as `_linear`)."""
    from epdraft.kernels._skinny_triton import skinny_gate_up_kernel

    T, K = x_TK.shape
    block_m = max(16, next_pow2(T))
    block_n, block_k, warps, stages = _launch_config(config, block_m, 2)
    I = w_gate.shape[0]
    out = torch.empty(T, I, dtype=x_TK.dtype, device=x_TK.device)
    skinny_gate_up_kernel[(-(-I // block_n),)](
        x_TK, w_gate, w_up, out, T, I, K, x_TK.stride(0), w_gate.stride(0), w_up.stride(0), out.stride(0),
        limit, alpha, SWIGLU=swiglu, HAS_LIMIT=limit > 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
