"""ExpertWeights: one grouped GEMM's expert weights in a format the fused kernels read.

    bf16   values [e, N, K] in x's dtype, no scales
    fp8    values [e, N, K] float8_e4m3fn, scales [e, ceil(N/bn), ceil(K/bk)] fp32 (`weight_scale_inv`)
    mxfp4  values [e, N, K/2] uint8 (two e2m1 a byte, low nibble first), scales [e, N, K/32] uint8 e8m0;
           with packing "shift" each 32-bit word's bits are permuted for the kernels' table-free decode
           (`epdraft.kernels.experts.e2m1.shift_pack`; `shift_packed` makes them where every scale allows it)
N and K are the logical (dequantized) sizes: w13 is [e, 2F, H] (gate rows, then up rows), w2 [e, H, F].
FP8 scales are those of the whole [N, K] matrix: for w13 of gate and up rows stacked, so a gate and
an up projection quantized apart stack into w13 only when F is a multiple of the block rows.
The checkpoint's own tensors are these, stacked per expert (`epdraft.loading.quant` says the formats
and holds their reference decode, `dequantize_weights`).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from epdraft.errors import ConfigError
from epdraft.kernels.experts.e2m1 import SHIFT_MAX_SCALE, shift_pack

WeightFormat = Literal["bf16", "fp8", "mxfp4"]
FORMAT_CODES = {"bf16": 0, "fp8": 1, "mxfp4": 2}
"""The kernels' W_FMT constexpr per format (3: mxfp4 with packing "shift")."""
Mxfp4Packing = Literal["nibbles", "shift"]


@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """Expert weights of one GEMM: values, scales (None for bf16), format, fp8 scale block (rows,
    cols) and the byte layout of mxfp4 values (module docstring)."""

    values: torch.Tensor
    scales: torch.Tensor | None = None
    format: WeightFormat = "bf16"
    block: tuple[int, int] = (1, 1)
    packing: Mxfp4Packing = "nibbles"

    def __post_init__(self) -> None:
        v, s, fmt = self.values, self.scales, self.format
        if fmt not in FORMAT_CODES:
            raise ConfigError(f"ExpertWeights: unknown format {fmt!r}; expected one of {sorted(FORMAT_CODES)}")
        if self.packing not in ("nibbles", "shift") or (self.packing == "shift" and fmt != "mxfp4"):
            raise ConfigError(f"ExpertWeights ({fmt}): packing {self.packing!r}; only mxfp4 values may be "
                              "'shift' packed, every format may be 'nibbles'")
        if v.dim() != 3:
            raise ConfigError(f"ExpertWeights ({fmt}): values have shape {tuple(v.shape)}, expected [e, N, K]")
        if fmt == "bf16":
            if s is not None:
                raise ConfigError("ExpertWeights (bf16): scales given for unquantized weights")
            return
        if s is None:
            raise ConfigError(f"ExpertWeights ({fmt}): missing scales")
        e, N, k = v.shape
        if fmt == "fp8":
            bn, bk = self.block
            expected, dtypes = (e, -(-N // bn), -(-k // bk)), (torch.float8_e4m3fn, torch.float32)
        else:
            expected, dtypes = (e, N, 2 * k // 32), (torch.uint8, torch.uint8)
        if tuple(s.shape) != expected:
            raise ConfigError(f"ExpertWeights ({fmt}): scales have shape {tuple(s.shape)}, expected {expected}")
        if (v.dtype, s.dtype) != dtypes:
            raise ConfigError(f"ExpertWeights ({fmt}): values/scales are {v.dtype}/{s.dtype}, expected "
                              f"{dtypes[0]}/{dtypes[1]}")
        if not (v.is_contiguous() and s.is_contiguous()):
            raise ConfigError(f"ExpertWeights ({fmt}): values and scales must be contiguous")

    @property
    def shape(self) -> tuple[int, int, int]:
        """(e, N, K): the dequantized weight's shape."""
        e, N, k = self.values.shape
        return (e, N, 2 * k) if self.format == "mxfp4" else (e, N, k)

    @property
    def code(self) -> int:
        return 3 if self.packing == "shift" else FORMAT_CODES[self.format]

    def shift_packed(self) -> ExpertWeights:
        """These mxfp4 weights with the shift decode's byte layout (a copy) when every scale is at most
        SHIFT_MAX_SCALE (real checkpoints' are: 2**1 or less); else, and for other formats, self.
        Reads the largest scale back to the host: call it at load, not in a captured step."""
        if self.format != "mxfp4" or self.packing == "shift" or int(self.scales.max()) > SHIFT_MAX_SCALE:
            return self
        return dataclasses.replace(self, values=shift_pack(self.values), packing="shift")

    @property
    def nbytes(self) -> int:
        """Bytes stored (values and scales): what a GEMM reading every expert moves."""
        scale_bytes = self.scales.numel() * self.scales.element_size() if self.scales is not None else 0
        return self.values.numel() * self.values.element_size() + scale_bytes


def as_weights(w: torch.Tensor | ExpertWeights) -> ExpertWeights:
    """A plain weight tensor as bf16 ExpertWeights; ExpertWeights pass through."""
    return w if isinstance(w, ExpertWeights) else ExpertWeights(w)
