"""build_ffn: the FFN module of one draft layer from its spec."""

from __future__ import annotations

import torch

from epdraft.config.ffn import DraftDenseFFNSpec
from epdraft.config.hf import DraftMixFFNSpec
from epdraft.dispatch import Dispatcher
from epdraft.errors import ConfigError
from epdraft.layers.mlp import DraftMLP
from epdraft.layers.moe import DraftMoE
from epdraft.layers.step_kernels import StepKernels


def build_ffn(
    spec: DraftMixFFNSpec,
    layer_id: int,
    hidden_size: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    dispatcher: Dispatcher | None = None,
    kernels: StepKernels | None = None,
) -> DraftMLP | DraftMoE:
    """DraftMLP for a dense layer, DraftMoE (placed by `dispatcher.layout`, default every expert) for a MoE layer,
    computing as `kernels` says (None: resolved for `device`, `dtype` and the spec).

    Weights are uninitialised until `load_weights` (which takes the checkpoint's tensors as stored, quantized
    per `spec.quantization` too); `check_loaded` says what is still missing.
    Raises ConfigError if `layer_id` is not a layer of `spec` or `hidden_size` disagrees with it.
    """
    if not 0 <= layer_id < spec.num_layers:
        raise ConfigError(f"layer_id {layer_id} out of range: the {spec.family} spec has {spec.num_layers} layers")
    if hidden_size != spec.hidden_size:
        raise ConfigError(f"hidden_size {hidden_size} != the {spec.family} spec's hidden_size {spec.hidden_size}")
    layer = spec.layers[layer_id]
    if kernels is None:
        layout = dispatcher.layout if dispatcher is not None else None
        kernels = StepKernels.resolve(device, dtype, ffn=spec, layout=layout)
    if isinstance(layer, DraftDenseFFNSpec):
        return DraftMLP(
            hidden_size,
            layer.intermediate_size,
            layer.activation,
            bias=layer.bias,
            layer_id=layer_id,
            dtype=dtype,
            device=device,
            kernels=kernels,
            quantization=spec.quantization,
        )
    return DraftMoE(layer, hidden_size, layer_id=layer_id, dispatcher=dispatcher, dtype=dtype, device=device,
                    kernels=kernels, quantization=spec.quantization)  # fmt: skip
