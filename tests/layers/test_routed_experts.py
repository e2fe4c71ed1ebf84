"""Which expert path runs is picked once, at construction, from the rank's StepKernels; the
shift-packed MXFP4 bytes go back to checkpoint order for a reload."""

import pytest
import torch

from epdraft.config.ffn import ActivationSpec
from epdraft.config.quant import QuantSpec
from epdraft.kernels.experts.fused import fused_experts, fused_experts_quantized
from epdraft.layers.experts import experts_reference
from epdraft.layers.routed_experts import RoutedExperts
from epdraft.layers.step_kernels import StepKernels
from epdraft.loading import ExpertShard


@pytest.mark.parametrize("impl", ["fused", "reference"])
@pytest.mark.parametrize("quantization", [None, QuantSpec(method="fp8", block=(128, 128))])
def test_experts_compute_with_the_function_their_kernels_chose(impl, quantization):
    experts = RoutedExperts(ExpertShard(num_experts=2, intermediate_size=128, hidden_size=128), ActivationSpec(),
                            quantization=quantization, kernels=StepKernels(experts=impl))
    expected = {("fused", False): fused_experts, ("fused", True): fused_experts_quantized,
                ("reference", False): experts_reference}
    if (impl, quantization is not None) in expected:
        assert experts._compute is expected[impl, quantization is not None]
    else:  # a quantized store without the fused kernels computes on its dequantization
        assert experts._compute.__name__ == "_dequantized_reference"


@pytest.mark.parametrize("scale_w2", [127, 130])  # 130: w2's scales stop its re-lay, w13 alone is packed
def test_shift_packed_mxfp4_experts_go_back_to_checkpoint_order_for_loading(scale_w2):
    """A load into experts re-laid for the kernels' shift decode must land in checkpoint order:
    `unpack_for_loading` restores every packed tensor's bytes exactly, leaves an unpacked one alone,
    and says whether `pack_for_kernels` had run (once)."""
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
