"""FP8 e4m3 -> bf16 in the fused-experts kernels with integer ops, not the conversion unit.

An e4m3 byte's seven magnitude bits (exponent 4, mantissa 3) shifted into a bf16's bits 4-10 (the
exponent's low four bits, the mantissa's top three) read as the byte's value times 2**-120 exactly:
bias 127 against 7 for normal codes, and e4m3's subnormals (exponent 0) land on bf16 subnormals
with the same mantissa. The sign goes from bit 7 to bit 15. A bf16 multiply by 2**120 then gives
the value, exact (a power of two on a value of four significant bits, never out of range; the
device keeps bf16 subnormal inputs, which tests/gpu checks for every byte). Per four bytes w
(four weights), `E4M3_PTX`:
    r  = prmt(w, w, 0x9180)           16-bit lanes (b0 with its sign byte-replicated above it, b1 so)
    lo = ((r << 4) & 0x87F087F0) * 2**120   magnitude to bits 4-10, a sign copy lands on bit 15
and the same for bytes 2 and 3 (0xB3A2): six integer ops and two bf16 multiplies, where Triton's
`.to(bf16)` of an fp8 tile runs two F2F and one F2FP per two weights on the conversion pipe
(a quarter of the ALU's rate on sm_90). The multiply sits in the asm: a bf16 multiply in Triton
after it would stop the dot operand's register layout from reaching the tile's load (a round trip
through shared memory). One difference from the conversion: e4m3fn's NaN (0x7F, 0xFF) reads as
+-480, not NaN; checkpoints hold none (quantizers clamp to +-448), and experts kept for the
kernels are refused at load when they do (`count_nan_codes`).
"""

from __future__ import annotations

import torch

E4M3_BF16_SCALE = 2.0**120
"""What the decoded bf16 is multiplied by to give the e4m3 value."""

E4M3_PTX = """
{
.reg .b32 r, k;
mov.b32 k, 0x7B807B80;
prmt.b32 r, $2, $2, 0x9180;
shl.b32 r, r, 4;
and.b32 r, r, 0x87F087F0;
mul.rn.bf16x2 $0, r, k;
prmt.b32 r, $2, $2, 0xB3A2;
shl.b32 r, r, 4;
and.b32 r, r, 0x87F087F0;
mul.rn.bf16x2 $1, r, k;
}
"""
"""Four e4m3 bytes -> their bf16 values, for `tl.inline_asm_elementwise(..., pack=4)`: $0, $1 the bf16
pairs of bytes 0-1 and 2-3; $2 the four bytes, byte i = element i. 0x7B80 is bf16 2**120; prmt
selector 0x9180: result bytes (w.b0, sign of w.b0, w.b1, sign of w.b1)."""
E4M3_CONSTRAINTS = "=r,=r,r"


def e4m3_bits_to_bf16(codes: torch.Tensor) -> torch.Tensor:
    """Torch mirror of `E4M3_PTX`'s bit placement per byte: uint8 e4m3 bit patterns -> bf16 of value * 2**-120."""
    c = codes.to(torch.int32)
    return ((((c & 0x7F) << 4) | ((c & 0x80) << 8)).to(torch.int16)).view(torch.bfloat16)


def count_nan_codes(values: torch.Tensor) -> int:
    """How many e4m3fn NaN codes (0x7F, 0xFF) `values` (float8_e4m3fn or its uint8 bytes) holds: the
    kernels' decode reads them as +-480, so experts kept for the kernels are refused when they hold any."""
    return int(((values.view(torch.uint8) & 0x7F) == 0x7F).sum())


def dequantize_e4m3_bits(codes: torch.Tensor) -> torch.Tensor:
    """What `E4M3_PTX` computes per weight (before the block scale): the placement times 2**120 in bf16."""
    return e4m3_bits_to_bf16(codes) * torch.tensor(E4M3_BF16_SCALE, dtype=torch.bfloat16)
