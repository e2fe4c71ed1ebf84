"""Dense projections of the draft step: the skinny Triton launches where the shapes fit, nn.Linear elsewhere.

Whether the launches run at all is the rank's `StepKernels` (`projections`, `step_ops`), resolved
once; which one runs per call depends on the row count only (`skinny.fits`).

Projections of one input (q / k / v, a gate / up pair) hold their weights as consecutive rows of
one tensor (`share_storage`), so above the skinny rows they run as one GEMM over the joint weight:
at 128 rows cuBLAS reads k's and v's 8 MB each at ~30 % of the copy rate on their own, for want of
output tiles to fill the SMs with (docs/performance.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epdraft.config.ffn import ActivationSpec
from epdraft.kernels.step import ops as step_ops, skinny
from epdraft.layers.activations import gated_act
from epdraft.layers.step_kernels import StepKernels


def share_storage(*linears: nn.Linear) -> None:
    """Re-hold the linears' weights (same input width, same dtype and device) as consecutive row
    blocks of one tensor, their values kept: loading copies into them in place, so they stay joint.
    Anything that replaces a weight tensor (`.to()`, `load_state_dict(assign=True)`) splits them
    again, which `joint_weight` notices: the projections then run one GEMM each, as before."""
    weights = [lin.weight for lin in linears]
    joint = torch.cat([w.detach() for w in weights])
    start = 0
    for lin, w in zip(linears, weights):
        lin.weight = nn.Parameter(joint[start : start + w.shape[0]], requires_grad=w.requires_grad)
        start += w.shape[0]


def joint_weight(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The [sum N, K] tensor the weights [N_i, K] are consecutive row blocks of, or None. One
    storage, not merely adjacent addresses: two tensors the allocator placed end to end are not."""
    first = weights[0]
    if first.dim() != 2 or not first.is_contiguous():
        return None
    storage, end = first.untyped_storage().data_ptr(), first.data_ptr()
    for w in weights:
        if (w.untyped_storage().data_ptr() != storage or w.data_ptr() != end or w.shape[1] != first.shape[1]
                or w.dtype != first.dtype or not w.is_contiguous()):  # fmt: skip
            return None
        end += w.numel() * w.element_size()
    return first.as_strided((sum(w.shape[0] for w in weights), first.shape[1]), first.stride())


def _joint_gemm(kernels: StepKernels, x_TK: torch.Tensor, linears: tuple[nn.Linear, ...]) -> list[torch.Tensor] | None:
    """The linears of x as one GEMM (column views of its output) where the rank runs the skinny
    projections (the GPU's path: a joint GEMM is their path above the skinny rows), the weights are
    joint and there is no bias; None otherwise. On the torch path (CPU, fp32) each keeps its own
    GEMM: the reference's numerics stay those of separate nn.Linear calls."""
    if kernels.projections != "skinny" or len(linears) < 2 or any(lin.bias is not None for lin in linears):
        return None
    weights = [lin.weight for lin in linears]
    joint = joint_weight(weights)
    if joint is None:
        return None
    return list(F.linear(x_TK, joint).split([w.shape[0] for w in weights], dim=-1))


def project(kernels: StepKernels, x_TK: torch.Tensor, *linears: nn.Linear) -> list[torch.Tensor]:
    """[linear(x) for linear in linears]: one skinny launch for all of them (outputs are column
    views of one buffer) when the rank runs them, there are at most 3, with no bias, and
    `skinny.fits` the rows; else, on that path, one GEMM over their joint weight (`share_storage`),
    or one nn.Linear call each."""
    weights = [lin.weight for lin in linears]
    if (kernels.projections == "skinny" and len(linears) <= 3 and all(lin.bias is None for lin in linears)
            and skinny.fits(x_TK, weights)):  # fmt: skip
        out = skinny.linear(x_TK, weights)
        return list(out.split([w.shape[0] for w in weights], dim=1))
    joint = _joint_gemm(kernels, x_TK, linears)
    return joint if joint is not None else [lin(x_TK) for lin in linears]


def gate_up(kernels: StepKernels, x_TK: torch.Tensor, gate: nn.Linear, up: nn.Linear, act: ActivationSpec) -> torch.Tensor:
    """act(gate x, up x) rounded to x's dtype (the activation in fp32): one skinny launch where it
    fits, else the two GEMMs (one over their joint weight on the skinny path, `share_storage`) and one
    activation launch (`step_ops` on Triton) or the torch chain."""
    swiglu = act.kind == "swiglu"
    if (kernels.projections == "skinny" and gate.bias is None and up.bias is None
            and skinny.fits(x_TK, [gate.weight, up.weight])):  # fmt: skip
        return skinny.gate_up_act(x_TK, gate.weight, up.weight, swiglu, act.limit, act.alpha)
    g_TI, u_TI = _joint_gemm(kernels, x_TK, (gate, up)) or (gate(x_TK), up(x_TK))
    if kernels.step_ops == "triton":
        return step_ops.gated_act(g_TI, u_TI, swiglu, act.limit, act.alpha)
    return gated_act(g_TI, u_TI, act).to(x_TK.dtype)
