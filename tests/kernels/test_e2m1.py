"""The MXFP4 bits path's upcasts (CPU): each decode's torch mirror (table lookups; the table-free
shift decode on shift-packed bytes) equals the reference dequantization for every code and scale it
takes, and its PTX text (run by the emulator) equals the mirror for every byte in every position."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from epdraft.kernels.experts.e2m1 import (
    E2M1_CONSTRAINTS,
    E2M1_HI_PTX,
    E2M1_LO_PTX,
    SHIFT_BIT_MAP,
    SHIFT_HI_PTX,
    SHIFT_LO_PTX,
    SHIFT_MAX_SCALE,
    dequantize_mxfp4_bits,
    dequantize_mxfp4_shift,
    e2m1_bits_to_bf16,
    e2m1_shift_to_bf16,
    shift_pack,
    shift_unpack,
)
from epdraft.loading.quant import E2M1_VALUES, dequantize_mxfp4
from tests.kernels.ptx_emulator import run_elementwise, run_ptx


def _every_byte_at_every_scale():
    """[256 scales, 16 groups, 16] blocks holding each byte value once per scale, and their scales."""
    blocks = torch.arange(256, dtype=torch.uint8).view(1, 16, 16).expand(256, 16, 16).contiguous()
    scales = torch.arange(256, dtype=torch.uint8).view(256, 1).expand(256, 16).contiguous()
    return blocks, scales


def test_codes_are_the_e2m1_values():
    codes = torch.arange(16, dtype=torch.uint8)
    assert e2m1_bits_to_bf16(codes).float().tolist() == list(E2M1_VALUES)
    assert e2m1_bits_to_bf16(codes)[8].view(torch.int16).item() == -0x8000  # code 8 is -0.0, as the reference


def test_bits_equal_the_reference_bit_for_bit_for_scales_1_to_254():
    blocks, scales = _every_byte_at_every_scale()
    bits = dequantize_mxfp4_bits(blocks, scales).view(torch.int16)
    ref = dequantize_mxfp4(blocks, scales, torch.bfloat16).view(torch.int16)
    # e = 1 .. 254: exact on an IEEE multiply (on the GPU e = 1's two subnormal results may flush)
    assert torch.equal(bits[1:255], ref[1:255])


def test_scales_0_and_255_are_read_as_zero_and_infinity():
    blocks, scales = _every_byte_at_every_scale()
    bits = dequantize_mxfp4_bits(blocks, scales)
    assert (bits[0] == 0).all()  # the reference keeps 2**-127 * value (subnormal)
    zero_code = torch.stack((blocks[255] & 7, blocks[255] >> 4 & 7), dim=-1).flatten(-2).flatten() == 0
    assert bits[255][zero_code].isnan().all() and bits[255][~zero_code].isinf().all()  # the reference: all NaN


@pytest.mark.parametrize("offset", range(4))
def test_ptx_equals_the_mirror_for_every_byte_in_every_position(offset):
    """Byte b at position `offset` of each 4-byte word, random bytes around it: the emulated asm's
    bf16 of every low and high nibble is the mirror's (so packing order and each lane are checked)."""
    rng = np.random.default_rng(offset)
    words = rng.integers(0, 256, size=(256, 4), dtype=np.uint8)
    words[:, offset] = np.arange(256, dtype=np.uint8)
    lo, = run_elementwise(E2M1_LO_PTX, E2M1_CONSTRAINTS, [words.reshape(-1)], [np.uint16], pack=4)
    hi, = run_elementwise(E2M1_HI_PTX, E2M1_CONSTRAINTS, [words.reshape(-1)], [np.uint16], pack=4)
    codes = torch.from_numpy(words.reshape(-1))
    assert np.array_equal(lo, e2m1_bits_to_bf16(codes & 0xF).view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(hi, e2m1_bits_to_bf16(codes >> 4).view(torch.int16).numpy().view(np.uint16))


def test_shift_packing_is_a_bit_permutation_of_each_word():
    assert sorted(SHIFT_BIT_MAP) == list(range(32))
    blocks = torch.randint(0, 256, (3, 7, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = shift_pack(blocks)
    assert torch.equal(shift_unpack(packed), blocks) and not torch.equal(packed, blocks)
    # each word's set bits are its own, moved: the popcount per 32-bit word is kept
    popcount = lambda t: np.unpackbits(t.numpy().view(np.uint8)).reshape(-1, 32).sum(1)  # noqa: E731
    assert np.array_equal(popcount(packed), popcount(blocks))
    with pytest.raises(ValueError, match="multiple of 4"):
        shift_pack(torch.zeros(2, 6, dtype=torch.uint8))


def test_shift_decode_equals_the_reference_bit_for_bit_for_scales_0_to_128():
    """Unlike the table decode, e = 0 and e = 1 are exact too (the reference's subnormal results)."""
    blocks, scales = _every_byte_at_every_scale()
    n = SHIFT_MAX_SCALE + 1
    shift = dequantize_mxfp4_shift(blocks[:n], scales[:n]).view(torch.int16)
    assert torch.equal(shift, dequantize_mxfp4(blocks[:n], scales[:n], torch.bfloat16).view(torch.int16))
    assert e2m1_shift_to_bf16(torch.tensor([1], dtype=torch.uint8)).float().item() == 0.5 * 2.0**-126


@pytest.mark.parametrize("offset", range(4))
def test_shift_ptx_equals_the_mirror_for_every_byte_in_every_position(offset):
    """As the table decode's test, on the shift-packed words: output element i is byte i's nibble."""
    rng = np.random.default_rng(10 + offset)
    words = rng.integers(0, 256, size=(256, 4), dtype=np.uint8)
    words[:, offset] = np.arange(256, dtype=np.uint8)
    codes = torch.from_numpy(words.reshape(-1))
    packed = shift_pack(codes.view(1, -1)).numpy().reshape(-1)
    lo, = run_elementwise(SHIFT_LO_PTX, E2M1_CONSTRAINTS, [packed], [np.uint16], pack=4)
    hi, = run_elementwise(SHIFT_HI_PTX, E2M1_CONSTRAINTS, [packed], [np.uint16], pack=4)
    assert np.array_equal(lo, e2m1_shift_to_bf16(codes & 0xF).view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(hi, e2m1_shift_to_bf16(codes >> 4).view(torch.int16).numpy().view(np.uint16))


def test_emulator_follows_the_ptx_isa():
    a, b = np.array([0x33221100], np.uint32), np.array([0xF7665544], np.uint32)
    prmt = lambda c: run_ptx(f"prmt.b32 $0, $1, $2, {c};", 1, [a, b])[0][0]  # noqa: E731
    assert prmt(0x3210) == 0x33221100 and prmt(0x7654) == 0xF7665544 and prmt(0x0404) == 0x00440044
    assert prmt(0x00F8) == 0x0000FF00  # msb of the selector nibble: byte 7's (0xF7) sign replicated
    lop3 = run_ptx("lop3.b32 $0, $1, $2, $3, 0xF8;", 1, [np.uint32(0xF0), np.uint32(0x3C), np.uint32(0x0F)])[0]
    assert lop3 == 0xFC  # a | (b & c)
    assert run_ptx("mul.hi.u32 $0, $1, 0x10000;", 1, [np.uint32(0xABCD1234)])[0] == 0xABCD


def test_emulator_refuses_what_it_does_not_know():
    with pytest.raises(ValueError, match="unsupported instruction 'add.u32 \\$0, \\$1, 1'"):
        run_ptx("add.u32 $0, $1, 1;", 1, [np.uint32(1)])
    with pytest.raises(ValueError, match="read before it is written"):
        run_ptx("and.b32 $0, t, 1;", 1, [np.uint32(1)])
