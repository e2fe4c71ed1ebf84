"""The kernels' MXFP4 upcasts (either decode) and FP8 upcast alone, as Triton kernels over flat bytes
(imported by GPU tests only)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epdraft.kernels.experts._triton import _e2m1_to_bf16, _e4m3_to_bf16, _e8m0_to_bf16

BLOCK = 4096


@triton.jit
def _upcast_kernel(w_ptr, s_ptr, lo_ptr, hi_ptr, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    scale = _e8m0_to_bf16(tl.load(s_ptr + offs), SHIFT)
    lo, hi = _e2m1_to_bf16(tl.load(w_ptr + offs), SHIFT)
    tl.store(lo_ptr + offs, lo * scale)
    tl.store(hi_ptr + offs, hi * scale)


def upcast(bytes_u8: torch.Tensor, scales_u8: torch.Tensor, shift: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[n] uint8 packed e2m1 bytes and [n] uint8 e8m0 scales (one per byte, equal within each 4-byte
    word for `shift`; n % 4096 == 0) on CUDA -> (bf16 of each low nibble, bf16 of each high nibble)
    times its scale, as the kernels compute them; `shift`: the bytes are `shift_pack`ed and the
    results come in checkpoint order."""
    lo = torch.empty(bytes_u8.shape, dtype=torch.bfloat16, device=bytes_u8.device)
    hi = torch.empty_like(lo)
    _upcast_kernel[(bytes_u8.numel() // BLOCK,)](bytes_u8, scales_u8, lo, hi, BLOCK=BLOCK, SHIFT=shift, num_warps=4)
    return lo, hi


@triton.jit
def _upcast_e4m3_kernel(w_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _e4m3_to_bf16(tl.load(w_ptr + offs)))


def upcast_e4m3(values: torch.Tensor) -> torch.Tensor:
    """[n] float8_e4m3fn on CUDA (n % 4096 == 0) -> bf16, as the kernels convert FP8 weight tiles."""
    out = torch.empty(values.shape, dtype=torch.bfloat16, device=values.device)
    _upcast_e4m3_kernel[(values.numel() // BLOCK,)](values, out, BLOCK=BLOCK, num_warps=4)
    return out
