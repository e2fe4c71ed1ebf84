"""Dense projections of the draft step: the skinny Triton launches where the shapes fit, nn.Linear elsewhere.

Whether the launches run at all is the rank's `StepKernels` (`projections`, `step_ops`), resolved
once; which one runs per call depends on the row count only (`skinny.fits`).
"""

from __future__ import annotations

import torch
from torch import nn

from epdraft.config.ffn import ActivationSpec
from epdraft.kernels.step import ops as step_ops, skinny
from epdraft.layers.activations import gated_act
from epdraft.layers.step_kernels import StepKernels


def project(kernels: StepKernels, x_TK: torch.Tensor, *linears: nn.Linear) -> list[torch.Tensor]:
    """[linear(x) for linear in linears]: one skinny launch for all of them (outputs are column
    views of one buffer) when the rank runs them, there are at most 3, with no bias, and
    `skinny.fits` the rows, else one nn.Linear call each."""
    weights = [lin.weight for lin in linears]
    if (kernels.projections == "skinny" and len(linears) <= 3 and all(lin.bias is None for lin in linears)
            and skinny.fits(x_TK, weights)):  # fmt: skip
        out = skinny.linear(x_TK, weights)
        return list(out.split([w.shape[0] for w in weights], dim=1))
    return [lin(x_TK) for lin in linears]


def gate_up(kernels: StepKernels, x_TK: torch.Tensor, gate: nn.Linear, up: nn.Linear, act: ActivationSpec) -> torch.Tensor:
    """act(gate x, up x) rounded to x's dtype (the activation in fp32): one skinny launch where it
    fits, else the two GEMMs and one activation launch (`step_ops` on Triton) or the torch chain."""
    swiglu = act.kind == "swiglu"
    if (kernels.projections == "skinny" and gate.bias is None and up.bias is None
            and skinny.fits(x_TK, [gate.weight, up.weight])):  # fmt: skip
        return skinny.gate_up_act(x_TK, gate.weight, up.weight, swiglu, act.limit, act.alpha)
    if kernels.step_ops == "triton":
        return step_ops.gated_act(gate(x_TK), up(x_TK), swiglu, act.limit, act.alpha)
    return gated_act(gate(x_TK), up(x_TK), act).to(x_TK.dtype)
