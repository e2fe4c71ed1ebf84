"""The FP8 weight upcast (CPU): the integer e4m3 -> bf16 of `epdraft.kernels.experts.e4m3` equals torch's
conversion for every byte (NaN aside), and its PTX (run by the emulator) does so in every position."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from epdraft.kernels.experts.e4m3 import E4M3_CONSTRAINTS, E4M3_PTX, count_nan_codes, dequantize_e4m3_bits, e4m3_bits_to_bf16
from tests.kernels.ptx_emulator import run_elementwise, run_ptx


def _conversion(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).to(torch.bfloat16)


def test_every_byte_is_the_conversion_nan_aside():
    codes = torch.arange(256, dtype=torch.uint8)
    got, ref = dequantize_e4m3_bits(codes), _conversion(codes)
    nan = ref.isnan()
    assert nan.sum() == 2 and torch.equal(got[~nan].view(torch.int16), ref[~nan].view(torch.int16))
    assert got[nan].tolist() == [480.0, -480.0]
    # the placement alone is the value times 2**-120: the smallest subnormal 2**-9 -> bf16 subnormal 2**-129
    assert e4m3_bits_to_bf16(torch.tensor([1], dtype=torch.uint8)).float().item() == 2.0**-129


@pytest.mark.parametrize("offset", range(4))
def test_ptx_equals_the_conversion_for_every_byte_in_every_position(offset):
    rng = np.random.default_rng(20 + offset)
    words = rng.integers(0, 256, size=(256, 4), dtype=np.uint8)
    words[:, offset] = np.arange(256, dtype=np.uint8)
    out, = run_elementwise(E4M3_PTX, E4M3_CONSTRAINTS, [words.reshape(-1)], [np.uint16], pack=4)
    assert np.array_equal(out, dequantize_e4m3_bits(torch.from_numpy(words.reshape(-1))).view(torch.int16).numpy()
                          .view(np.uint16))


def test_emulator_bf16_multiply_rounds_to_nearest_even_and_keeps_subnormals():
    mul = lambda a, b: int(run_ptx("mul.rn.bf16x2 $0, $1, $2;", 1, [np.uint32(a), np.uint32(b)])[0])  # noqa: E731
    assert mul(0x3FC0_4000, 0x4000_3F80) == 0x4040_4000  # (1.5, 2) * (2, 1) = (3, 2)
    assert mul(0x0001, 0x4300) == 0x0080  # 2**-133 (a subnormal) * 128 = 2**-126
    assert mul(0x3F81, 0x3F81) == 0x3F82  # 1.0078125**2 = 1.01568...: nearest bf16 is 1.015625
    assert run_ptx("mov.b32 $0, 0x7B807B80;", 1, [np.uint32(0)])[0] == 0x7B807B80


def test_nan_codes_are_counted_as_torch_reads_them():
    codes = torch.arange(256, dtype=torch.uint8)
    assert count_nan_codes(codes) == int(_conversion(codes).isnan().sum()) == 2
    values = torch.tensor([1.0, -448.0, 0.0], dtype=torch.float8_e4m3fn)
    assert count_nan_codes(values) == 0
    assert count_nan_codes(torch.cat([values.view(torch.uint8), torch.tensor([0xFF], dtype=torch.uint8)])) == 1
