"""DraftMLP: the dense gated MLP of dense layers and of the shared expert."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from epdraft.dispatch.plan import StepPlan
from epdraft.config.ffn import ActivationSpec
from epdraft.layers.activations import gated_act
from epdraft.loading import TensorSource, check_ffn_loaded, load_into


class DraftMLP(nn.Module):
    """y = down(act(gate x, up x)), optionally times sigmoid(output_gate x) (the Qwen2/3.5 shared-expert gate).

    Parameters (canonical loader names): `gate_proj.weight [I, H]`, `up_proj.weight [I, H]`,
    `down_proj.weight [H, I]`, with `.bias` when `bias`, and `output_gate.weight [1, H]` when
    `output_gate`. The activation runs in fp32 (SpecForge reference), so does the sigmoid gate.
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
    ) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.activation = activation
        self.layer_id = layer_id
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, **kw)
        self.output_gate = nn.Linear(hidden_size, 1, bias=False, **kw) if output_gate else None
        self.requires_grad_(False)
        self.loaded_pieces: set = set()

    def forward(self, x_TH: torch.Tensor, plan: StepPlan | None = None) -> torch.Tensor:
        """x_TH [T, H] -> [T, H] in x's dtype; T may be 0. `plan` is unused (a dense FFN never
        communicates); it is taken so every FFN of a draft layer is called alike."""
        h_TI = gated_act(self.gate_proj(x_TH), self.up_proj(x_TH), self.activation).to(x_TH.dtype)
        y_TH = self.down_proj(h_TI)
        if self.output_gate is not None:
            y_TH = (torch.sigmoid(self.output_gate(x_TH).float()) * y_TH.float()).to(x_TH.dtype)
        return y_TH

    def load_weights(self, named_tensors: Mapping[str, torch.Tensor] | TensorSource) -> set[str]:
        """Copy this layer's tensors from any accepted naming; returns the names consumed, ignores others."""
        return load_into(self, named_tensors, self.layer_id)

    def check_loaded(self) -> None:
        """Raise LoadError listing every tensor this MLP still lacks."""
        check_ffn_loaded(self, self.layer_id)
