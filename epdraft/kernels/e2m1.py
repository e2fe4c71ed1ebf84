"""MXFP4 -> bf16 in the fused-experts kernels without `tl.dot_scaled`: the bit construction.

The kernels' `mxfp4_upcast = "bits"` path turns each byte of packed e2m1 codes (element 2j in the
low nibble, 2j+1 in the high one, as `epdraft.loading.quant` stores them) into two bf16 weights
with 32-bit integer ops on four bytes at a time (`E2M1_LO_PTX`, `E2M1_HI_PTX`: Triton inline PTX),
then multiplies them by the group's scale 2**(e - 127) as a bf16. The low nibbles are the weights
of the even K columns, the high nibbles those of the odd ones; the kernels multiply them with the
activations' even and odd columns (two dots of half the K each), so no weight tile is interleaved.

Per four bytes w (eight weights), with `prmt` (byte permute: four selector nibbles each pick one
of the eight bytes of two registers) as an eight-entry table lookup:
    s   = w & 0x77777777                         each code's magnitude, one selector nibble each
    HB  = prmt(TAB_HI, s), LB = prmt(TAB_LO, s)  high / low bf16 byte of 0, .5, 1, 1.5, 2, 3, 4, 6
    HB |= prmt(w << 4, w, 0x5140) & 0x80808080   each nibble's sign (its bit 3) onto its byte's bit 7
    lo  = prmt(LB, HB, 0x6240), hi = prmt(LB, HB, 0x7351)   bytes paired into bf16x2 registers
and the same for the upper two bytes (selectors s >> 16). That is 13 integer-ALU ops per eight
weights (the shifts go to the multiply pipe as IMAD); with the rest of the main loop about 2.0 per
weight, against 5.3 through Triton 3.6's `dot_scaled` on sm_90 (tools/kernel_sass.py prints both).
The integer ALU runs at half the issue rate, and the upcast is what bounds these kernels at small T.

Every table value is a normal bf16 (e2m1's 0.5 is 0x3F00, never a subnormal pattern), zero is
0x0000 (0x8000 for code 8), and the only float op is the scale multiply (`mul.rn.bf16x2`, HMUL2):
a normal bf16 times a normal power of two, which no flush-to-zero can touch.

Exactness against `epdraft.loading.quant.dequantize_mxfp4` rounded to bf16, bit for bit:
    1 <= e <= 254  exact, except that e = 1 makes codes 1 and 9 (+-0.5 * 2**-126) subnormal,
                   which the GPU's bf16 multiply may flush to zero; from e = 253 on, the values
                   past bf16's range overflow to +-inf in both.
    e = 0          the scale is read as 0 (the reference's 2**-127 is a subnormal bf16): zeros.
    e = 255        the scale is read as +inf (the reference's NaN): +-inf, NaN for codes 0 and 8.
Real checkpoints keep e far inside [2, 252]; the quantizers write e = 0 only for all-zero groups,
where both give zeros.
"""

from __future__ import annotations

import torch

TAB_HI = (0x3F3F3F00, 0x40404040)
"""bf16 high bytes of the e2m1 magnitudes 0, .5, 1, 1.5 | 2, 3, 4, 6, as prmt's (a, b) operands."""
TAB_LO = (0xC0800000, 0xC0804000)
"""bf16 low bytes of the same magnitudes."""


def _ptx(pairs: str) -> str:
    """The lookup both halves share, then `pairs` (the prmt selector pairing LB, HB bytes into bf16)."""
    return f"""
{{
.reg .b32 s, sh, w4, hb, lb, hb2, lb2, m;
and.b32 s, $2, 0x77777777;
mul.hi.u32 sh, s, 0x10000;
prmt.b32 hb, {TAB_HI[0]:#010x}, {TAB_HI[1]:#010x}, s;
prmt.b32 lb, {TAB_LO[0]:#010x}, {TAB_LO[1]:#010x}, s;
prmt.b32 hb2, {TAB_HI[0]:#010x}, {TAB_HI[1]:#010x}, sh;
prmt.b32 lb2, {TAB_LO[0]:#010x}, {TAB_LO[1]:#010x}, sh;
shl.b32 w4, $2, 4;
prmt.b32 m, w4, $2, 0x5140;
lop3.b32 hb, hb, m, 0x80808080, 0xF8;
prmt.b32 m, w4, $2, 0x7362;
lop3.b32 hb2, hb2, m, 0x80808080, 0xF8;
prmt.b32 $0, lb, hb, {pairs};
prmt.b32 $1, lb2, hb2, {pairs};
}}
"""


E2M1_LO_PTX = _ptx("0x6240")
"""Four packed bytes -> the bf16 values of their four low nibbles (unscaled), for
`tl.inline_asm_elementwise(..., pack=4)`: $0, $1 the bf16 pairs of bytes 0-1 and 2-3; $2 the four
bytes, byte i = element i (Triton packs element 0 in the low bits).

One input and one output on purpose: Triton moves a dot operand's register layout up through a
pure unary asm to the shared-memory load of the bytes, so the tile goes from shared memory straight
into the MMA's registers (an asm with more operands or results costs a shared-memory round trip of
the bf16 tile). `mul.hi` by 2**16 is the shift right by 16 on the multiply pipe; `shl` becomes an
IMAD too. The sign masks (prmt 0x5140: bytes w4.b0, w.b0, w4.b1, w.b1) carry the signs of nibbles
l0, h0, l1, h1 in their bit 7, the order of HB's bytes; lop3 0xF8 is a | (b & c).
"""
E2M1_HI_PTX = _ptx("0x7351")
"""The same for the four high nibbles. Its first eleven instructions are the low half's: ptxas
computes them once for both."""
E2M1_CONSTRAINTS = "=r,=r,r"


def e8m0_to_bf16_scale(scales: torch.Tensor) -> torch.Tensor:
    """The kernels' bf16 scale operand for uint8 e8m0 exponents: the bits e << 7, i.e. 2**(e - 127)
    for 1 <= e <= 254, 0 for e = 0 and +inf for e = 255 (module docstring)."""
    return (scales.to(torch.int16) << 7).view(torch.bfloat16)


def e2m1_bits_to_bf16(codes: torch.Tensor) -> torch.Tensor:
    """Torch mirror of the PTX's table lookup and sign placement: uint8 codes (0-15) -> unscaled bf16."""
    mag = codes.to(torch.int32) & 7
    index = torch.arange(8, device=codes.device)
    hi_table = (torch.tensor(TAB_HI, device=codes.device)[index // 4] >> (8 * (index % 4))) & 0xFF
    lo_table = (torch.tensor(TAB_LO, device=codes.device)[index // 4] >> (8 * (index % 4))) & 0xFF
    bits = ((hi_table[mag] | ((codes.to(torch.int32) & 8) << 4)) << 8) | lo_table[mag]
    return bits.to(torch.int16).view(torch.bfloat16)


def dequantize_mxfp4_bits(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What the bits path computes: [..., N, G, 16] uint8 blocks, [..., N, G] uint8 scales -> [..., N, 32 G] bf16.

    The same table bytes, sign placement and one bf16 multiply per weight (bf16 * bf16 rounded once,
    as mul.rn.bf16x2 rounds); tests hold it against `dequantize_mxfp4` and the PTX text against it.
    """
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).flatten(-2)  # [..., N, G, 32] in element order
    return (e2m1_bits_to_bf16(codes) * e8m0_to_bf16_scale(scales).unsqueeze(-1)).flatten(-2)
