"""ExpertWeights (CPU): shapes and dtypes each format needs, refusals naming what is wrong, the reference dequantization."""

from __future__ import annotations

import pytest
import torch

from epdraft.errors import ConfigError
from epdraft.kernels.experts.weights import ExpertWeights
from epdraft.loading.quant import dequantize_fp8, dequantize_mxfp4, dequantize_weights, quantize_weights


def test_formats_shapes_bytes_and_dequantization():
    w = torch.randn(3, 256, 384) * 0.05
    fp8 = quantize_weights(w, "fp8")
    assert fp8.shape == (3, 256, 384) and fp8.scales.shape == (3, 2, 3)
    assert fp8.nbytes == 3 * 256 * 384 + 3 * 2 * 3 * 4
    assert torch.equal(dequantize_weights(fp8, torch.bfloat16), dequantize_fp8(fp8.values, fp8.scales, (128, 128), torch.bfloat16))
    mx = quantize_weights(w, "mxfp4")
    assert mx.values.shape == (3, 256, 192) and mx.shape == (3, 256, 384) and mx.scales.shape == (3, 256, 12)
    assert mx.nbytes == 3 * 256 * (192 + 12)  # 4.25 bits a weight
    blocks = mx.values.view(3, 256, 12, 16)
    assert torch.equal(dequantize_weights(mx, torch.float32), dequantize_mxfp4(blocks, mx.scales, torch.float32))


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(values=torch.zeros(2, 4, 8, dtype=torch.uint8), format="mxfp4"), "missing scales"),
        (dict(values=torch.zeros(2, 4, 8, dtype=torch.uint8), scales=torch.zeros(2, 4, 2, dtype=torch.uint8),
              format="mxfp4"), "scales have shape (2, 4, 2), expected (2, 4, 0)"),
        (dict(values=torch.zeros(2, 4, 64, dtype=torch.float8_e4m3fn), scales=torch.zeros(2, 1, 2), format="fp8",
              block=(128, 128)), "expected (2, 1, 1)"),
        (dict(values=torch.zeros(2, 4, 64), scales=torch.zeros(2, 1, 1), format="fp8", block=(128, 128)),
         "expected torch.float8_e4m3fn/torch.float32"),
        (dict(values=torch.zeros(4, 64)), "expected [e, N, K]"),
        (dict(values=torch.zeros(2, 4, 64), format="int4"), "unknown format 'int4'"),
        (dict(values=torch.zeros(2, 4, 64), packing="shift"), "only mxfp4 values may be 'shift' packed"),
    ],
)
def test_refusals_name_what_is_wrong(kwargs, needle):
    with pytest.raises(ConfigError) as info:
        ExpertWeights(**kwargs)
    assert needle in str(info.value)


def test_shift_packing_keeps_the_weights_and_falls_back_past_its_scales():
    """shift_packed: the same dequantized weights under W_FMT 3; weights with a scale over 2**1
    (e > 128, which the decode's scale operand cannot hold) and other formats stay as they are."""
    w = torch.randn(3, 64, 256) * 0.05
    mx = quantize_weights(w, "mxfp4")
    shifted = mx.shift_packed()
    assert (shifted.packing, shifted.code, mx.code) == ("shift", 3, 2)
    assert not torch.equal(shifted.values, mx.values)  # the bytes did move
    assert torch.equal(dequantize_weights(shifted, torch.float32), dequantize_weights(mx, torch.float32))
    assert shifted.shift_packed() is shifted
    big = quantize_weights(w * 32, "mxfp4")  # |w| up to ~8: the largest scale 2**1 (e = 128)
    assert int(big.scales.max()) == 128 and big.shift_packed().packing == "shift"
    bigger = quantize_weights(w * 64, "mxfp4")
    assert int(bigger.scales.max()) > 128 and bigger.shift_packed() is bigger
    fp8 = quantize_weights(w, "fp8")
    assert fp8.shift_packed() is fp8
