"""DraftMLP: the dense gated MLP of dense layers and of the shared expert."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from epdraft.dispatch.plan import StepPlan
from epdraft.config.ffn import ActivationSpec
from epdraft.config.quant import QuantSpec
from epdraft.kernels.step.ops import Epilogue, ffn_residual, refuse_epilogue
from epdraft.layers.projection import gate_up, project, share_storage
from epdraft.layers.step_kernels import StepKernels
from epdraft.loading import TensorSource, check_ffn_loaded, load_into


def gate_output(y_TH: torch.Tensor, gate_T1: torch.Tensor | None) -> torch.Tensor:
    """sigmoid(gate) * y in fp32, rounded to y's dtype (the Qwen2/3.5 shared-expert gate); y when ungated."""
    if gate_T1 is None:
        return y_TH
    return (torch.sigmoid(gate_T1.float()) * y_TH.float()).to(y_TH.dtype)


class DraftMLP(nn.Module):
    """y = down(act(gate x, up x)), optionally times sigmoid(output_gate x) (the Qwen2/3.5 shared-expert gate).

    Parameters (canonical loader names): `gate_proj.weight [I, H]`, `up_proj.weight [I, H]`,
    `down_proj.weight [H, I]`, with `.bias` when `bias`, and `output_gate.weight [1, H]` when
    `output_gate`. The activation runs in fp32 (SpecForge reference), so does the sigmoid gate.
    `kernels`: the rank's resolved compute (None: resolved for `device` and `dtype`).
    `quantization`: how the checkpoint stores the weights (its `quantization_config`): raw stored
    tensors handed to `load_weights` are read dequantized through it.
    """

    expert_shard = None  # the loader's view: a dense MLP holds no routed experts

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: ActivationSpec = ActivationSpec(),
        *,
        bias: bool = False,
        output_gate: bool = False,
        layer_id: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        kernels: StepKernels | None = None,
        quantization: QuantSpec | None = None,
    ) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.quantization = quantization
        self.kernels = kernels if kernels is not None else StepKernels.for_device(device, dtype)
        self.activation = activation
        self.layer_id = layer_id
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, **kw)
        share_storage(self.gate_proj, self.up_proj)  # one GEMM above the skinny rows
        self.output_gate = nn.Linear(hidden_size, 1, bias=False, **kw) if output_gate else None
        self.requires_grad_(False)
        self.loaded_pieces: set = set()

    def forward(
        self,
        x_TH: torch.Tensor,
        plan: StepPlan | None = None,
        *,
        residual_TH: torch.Tensor | None = None,
        epilogue: Epilogue | None = None,
    ) -> torch.Tensor:
        """x_TH [T, H] -> [T, H] in x's dtype, plus `residual_TH` when given (the layer's residual
        add, fused into one launch with the Triton step ops); T may be 0. `plan` is unused (a dense
        FFN never communicates); it is taken so every FFN of a draft layer is called alike.
        `epilogue` (Triton step ops, with a residual): that launch also writes the next norm and
        the layer's non-finite flag (`step_ops.Epilogue`)."""
        y_TH = self.ungated(x_TH)
        if self.kernels.step_ops == "triton" and (residual_TH is not None or self.output_gate is not None):
            return self.add_gated(x_TH, y_TH, residual_TH, epilogue=epilogue)
        refuse_epilogue("DraftMLP", epilogue)
        y_TH = self.gated(x_TH, y_TH)
        return y_TH if residual_TH is None else residual_TH + y_TH

    def ungated(self, x_TH: torch.Tensor) -> torch.Tensor:
        """down(act(gate x, up x)) [T, H]: the MLP before its output gate, which a caller may fuse
        into its own add (`add_gated`; `DraftMoE` does)."""
        h_TI = gate_up(self.kernels, x_TH, self.gate_proj, self.up_proj, self.activation)
        return project(self.kernels, h_TI, self.down_proj)[0]

    def gated(self, x_TH: torch.Tensor, y_TH: torch.Tensor) -> torch.Tensor:
        """y * sigmoid(output_gate x) (the torch chain), or y when there is no output gate."""
        return gate_output(y_TH, self.output_gate(x_TH) if self.output_gate is not None else None)

    def add_gated(
        self,
        x_TH: torch.Tensor,
        y_TH: torch.Tensor,
        residual_TH: torch.Tensor | None,
        routed_TH: torch.Tensor | None = None,
        *,
        epilogue: Epilogue | None = None,
    ) -> torch.Tensor:
        """[residual +] ([routed +] y [* sigmoid(output_gate x)]) in one Triton launch, the output
        gate's product with x computed inside it (`ffn_residual`; with its `epilogue`)."""
        gate = {} if self.output_gate is None else {"gate_rows_TH": x_TH, "gate_weight_1H": self.output_gate.weight}
        return ffn_residual(residual_TH, routed_TH, y_TH, **gate, epilogue=epilogue)

    def load_weights(self, named_tensors: Mapping[str, torch.Tensor] | TensorSource) -> set[str]:
        """Copy this layer's tensors from any accepted naming; returns the names consumed, ignores others."""
        return load_into(self, named_tensors, self.layer_id)

    def check_loaded(self) -> None:
        """Raise LoadError listing every tensor this MLP still lacks."""
        check_ffn_loaded(self, self.layer_id)
