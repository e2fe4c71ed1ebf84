"""Which expert path runs: the fused kernels take bf16/fp16 on CUDA; anything else there is the
reference loop, which DraftRuntime.build announces with the reason."""

import pytest
import torch

from epdraft.layers.routed_experts import reference_fallback_reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_outside_the_fused_dtypes_names_the_fallback(dtype):
    reason = reference_fallback_reason("cuda", dtype)
    name = str(dtype).removeprefix("torch.")
    assert reason is not None and f"the draft is {name}" in reason
    assert "per-expert reference loop" in reason and "--dtype bfloat16" in reason


@pytest.mark.parametrize("device,dtype", [("cuda", torch.bfloat16), ("cuda:1", torch.float16), ("cpu", torch.float32)])
def test_fused_dtypes_on_cuda_and_cpu_give_no_reason(device, dtype):
    assert reference_fallback_reason(device, dtype) is None
