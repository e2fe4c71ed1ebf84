"""Gated activations shared by dense MLPs, shared experts, routed experts and the GPU kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epdraft.config.ffn import ActivationSpec


def gated_act(gate: torch.Tensor, up: torch.Tensor, act: ActivationSpec) -> torch.Tensor:
    """act(gate, up) in fp32 (the SpecForge reference computes SwiGLU in fp32), returned in fp32.

    swiglu: silu(gate) * up; swigluoai (gpt-oss): (up + 1) * gate * sigmoid(alpha * gate).
    With `limit > 0` gate is clamped to <= limit and up to [-limit, limit] first.
    """
    gate, up = gate.float(), up.float()
    if act.limit > 0:
        gate = gate.clamp(max=act.limit)
        up = up.clamp(-act.limit, act.limit)
    if act.kind == "swiglu":
        return F.silu(gate) * up
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))
