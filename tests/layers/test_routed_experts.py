"""Which expert path runs: the fused kernels take bf16/fp16 on CUDA; anything else there is the
reference loop, which DraftRuntime.build announces with the reason."""

import pytest
import torch

from epdraft.config.ffn import ActivationSpec
from epdraft.layers.routed_experts import RoutedExperts, reference_fallback_reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_outside_the_fused_dtypes_names_the_fallback(dtype):
    reason = reference_fallback_reason("cuda", dtype)
    name = str(dtype).removeprefix("torch.")
    assert reason is not None and f"the draft is {name}" in reason
    assert "per-expert reference loop" in reason and "--dtype bfloat16" in reason


@pytest.mark.parametrize("device,dtype", [("cuda", torch.bfloat16), ("cuda:1", torch.float16), ("cpu", torch.float32)])
def test_fused_dtypes_on_cuda_and_cpu_give_no_reason(device, dtype):
    assert reference_fallback_reason(device, dtype) is None


@pytest.mark.parametrize("scale_w2", [127, 130])  # 130: w2's scales stop its re-lay, w13 alone is packed
def test_shift_packed_mxfp4_experts_go_back_to_checkpoint_order_for_loading(scale_w2):
    """A load into experts re-laid for the kernels' shift decode must land in checkpoint order:
    `unpack_for_loading` restores every packed tensor's bytes exactly, leaves an unpacked one alone,
    and says whether `pack_for_kernels` had run (once)."""
    from epdraft.config.quant import QuantSpec
    from epdraft.loading import ExpertShard

    experts = RoutedExperts(ExpertShard(num_experts=2, intermediate_size=64, hidden_size=64), ActivationSpec(),
                            quantization=QuantSpec(method="mxfp4", block=(1, 32)))
    gen = torch.Generator().manual_seed(3)
    for w in (experts.w13, experts.w2):
        w.data.copy_(torch.randint(0, 256, w.shape, dtype=torch.uint8, generator=gen))
    experts.w13_scale.data.fill_(127)
    experts.w2_scale.data.fill_(scale_w2)
    stored = experts.w13.data.clone(), experts.w2.data.clone()
    assert not experts.unpack_for_loading()
    # what pack_for_kernels does on CUDA
    w13, w2 = (w.shift_packed() for w in experts.weights())
    assert w13.packing == "shift" and not torch.equal(w13.values, stored[0])
    assert w2.packing == ("shift" if scale_w2 <= 128 else "nibbles")
    experts.w13.data, experts.w13_packing = w13.values, w13.packing
    experts.w2.data, experts.w2_packing = w2.values, w2.packing
    experts.prepared_for_kernels = True
    assert experts.unpack_for_loading()
    assert torch.equal(experts.w13.data, stored[0]) and torch.equal(experts.w2.data, stored[1])
    assert (experts.w13_packing, experts.w2_packing) == ("nibbles", "nibbles")
    assert not experts.unpack_for_loading()
