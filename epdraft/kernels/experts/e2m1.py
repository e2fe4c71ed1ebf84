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


# The shift decode: no tables. A code's three magnitude bits placed at bf16 bits 6-8 (the exponent's
# low two bits and the mantissa's top bit) read as the code's value times 2**-126 exactly (0.5 a
# subnormal), its sign at bit 15; the scale multiply is then by 2**(e - 1) instead of 2**(e - 127).
# For that to cost one shift and one mask per bf16 pair, the weights are stored with each 32-bit word's
# bits permuted at load (`shift_pack`): the pair (L0, L1) of the word's first two low nibbles sits
# under the mask 0x81C081C0 (bits 6-8 and 15, 22-24 and 31), (L2, L3) three bits lower, (H0, H1) of
# the high nibbles six bits lower, and (H2, H3) in the eight bits left, gathered by three shifts.
SHIFT_MAX_SCALE = 128
"""The largest e8m0 exponent the shift decode takes: its scale operand 2**(e - 1) must be a finite bf16."""

_SHIFT_CODE_BITS = {  # code (nibble of the checkpoint word: L_i = byte i's low nibble) -> its bits'
    # positions in the shift-packed word: magnitude bits 0, 1, 2, then the sign
    "L0": (6, 7, 8, 15), "L1": (22, 23, 24, 31), "L2": (3, 4, 5, 12), "L3": (19, 20, 21, 28),
    "H0": (0, 1, 2, 9), "H1": (16, 17, 18, 25), "H2": (10, 11, 13, 14), "H3": (26, 27, 29, 30),
}  # fmt: skip
SHIFT_BIT_MAP = tuple(
    _SHIFT_CODE_BITS[f"{'LH'[b % 8 // 4]}{b // 8}"][b % 4] for b in range(32)
)
"""SHIFT_BIT_MAP[b]: where bit b of a checkpoint word (4 packed bytes, byte 0 lowest) goes in the
shift-packed word."""

SHIFT_LO_PTX = """
{
.reg .b32 t;
and.b32 $0, $2, 0x81C081C0;
shl.b32 t, $2, 3;
and.b32 $1, t, 0x81C081C0;
}
"""
"""Four shift-packed bytes -> the bf16 values of their low nibbles times 2**-126 (`E2M1_LO_PTX`'s
operands and order): (L0, L1) under the mask, (L2, L3) three bits up."""
SHIFT_HI_PTX = """
{
.reg .b32 t, t4, t5, t1;
shl.b32 t, $2, 6;
and.b32 $0, t, 0x81C081C0;
shr.u32 t4, $2, 4;
shr.u32 t5, $2, 5;
shl.b32 t1, $2, 1;
and.b32 $1, t4, 0x00C000C0;
lop3.b32 $1, t5, $1, 0x01000100, 0xEC;
lop3.b32 $1, t1, $1, 0x80008000, 0xEC;
}
"""
"""The same for the high nibbles: (H0, H1) six bits up; (H2, H3) from bits 10, 11 (>> 4), 13 (>> 5)
and 14 (<< 1) and the same sixteen higher; lop3 0xEC is (a & c) | b."""


def _permute_bits(words: torch.Tensor, bit_map: tuple[int, ...]) -> torch.Tensor:
    """int64 words (32 bits used) with bit b moved to bit_map[b], bits that move alike moved together."""
    out = torch.zeros_like(words)
    moves: dict[int, int] = {}
    for b, to in enumerate(bit_map):
        moves[to - b] = moves.get(to - b, 0) | (1 << b)
    for delta, mask in moves.items():
        part = words & mask
        out |= part << delta if delta >= 0 else part >> -delta
    return out


def _repack(values: torch.Tensor, bit_map: tuple[int, ...]) -> torch.Tensor:
    if values.dtype != torch.uint8 or values.shape[-1] % 4 or not values.is_contiguous():
        raise ValueError(f"shift packing takes contiguous uint8 bytes, a multiple of 4 per row; got "
                         f"{values.dtype} {tuple(values.shape)}")
    out = torch.empty_like(values)
    flat_in, flat_out = values.view(-1, values.shape[-1]), out.view(-1, values.shape[-1])
    rows = max(1, (1 << 24) // max(1, values.shape[-1]))  # ~16 MB of bytes at a time: int64 temporaries
    for first in range(0, flat_in.shape[0], rows):
        words = flat_in[first:first + rows].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        flat_out[first:first + rows].view(torch.int32).copy_(_permute_bits(words, bit_map).to(torch.int32))
    return out


def shift_pack(values: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 bytes [..., n] (n % 4 == 0, contiguous) -> the shift decode's layout (a new tensor)."""
    return _repack(values, SHIFT_BIT_MAP)


def shift_unpack(values: torch.Tensor) -> torch.Tensor:
    """Inverse of `shift_pack`: the checkpoint's byte layout back."""
    inverse = [0] * 32
    for b, to in enumerate(SHIFT_BIT_MAP):
        inverse[to] = b
    return _repack(values, tuple(inverse))


def e8m0_to_shift_scale(scales: torch.Tensor) -> torch.Tensor:
    """The shift decode's bf16 scale operand: 2**(e - 1) (bits (e + 126) << 7), for e <= SHIFT_MAX_SCALE."""
    return ((scales.to(torch.int16) + 126) << 7).view(torch.bfloat16)


def e2m1_shift_to_bf16(codes: torch.Tensor) -> torch.Tensor:
    """Torch mirror of the shift decode per code: uint8 codes (0-15) -> bf16 of value * 2**-126."""
    c = codes.to(torch.int32)
    return ((((c & 7) << 6) | ((c & 8) << 12)).to(torch.int16)).view(torch.bfloat16)


def dequantize_mxfp4_shift(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What the shift decode computes, as `dequantize_mxfp4_bits` for the table decode: checkpoint-order
    blocks [..., N, G, 16], scales [..., N, G] (every e <= SHIFT_MAX_SCALE) -> [..., N, 32 G] bf16."""
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).flatten(-2)
    return (e2m1_shift_to_bf16(codes) * e8m0_to_shift_scale(scales).unsqueeze(-1)).flatten(-2)
