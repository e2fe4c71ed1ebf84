"""ExpertWeights (CPU): shapes and dtypes each format needs, refusals naming what is wrong, the reference dequantization."""

from __future__ import annotations

import pytest
import torch

from epdraft.errors import ConfigError
from epdraft.kernels.tuning import quantize_weights
from epdraft.kernels.weights import ExpertWeights
from epdraft.loading.quant import dequantize_fp8, dequantize_mxfp4


def test_formats_shapes_bytes_and_dequantization():
    w = torch.randn(3, 256, 384) * 0.05
    fp8 = quantize_weights(w, "fp8")
    assert fp8.shape == (3, 256, 384) and fp8.scales.shape == (3, 2, 3)
    assert fp8.nbytes == 3 * 256 * 384 + 3 * 2 * 3 * 4
    assert torch.equal(fp8.dequantized(torch.bfloat16), dequantize_fp8(fp8.values, fp8.scales, (128, 128), torch.bfloat16))
    mx = quantize_weights(w, "mxfp4")
    assert mx.values.shape == (3, 256, 192) and mx.shape == (3, 256, 384) and mx.scales.shape == (3, 256, 12)
    assert mx.nbytes == 3 * 256 * (192 + 12)  # 4.25 bits a weight
    blocks = mx.values.view(3, 256, 12, 16)
    assert torch.equal(mx.dequantized(torch.float32), dequantize_mxfp4(blocks, mx.scales, torch.float32))


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
    ],
)
def test_refusals_name_what_is_wrong(kwargs, needle):
    with pytest.raises(ConfigError) as info:
        ExpertWeights(**kwargs)
    assert needle in str(info.value)
