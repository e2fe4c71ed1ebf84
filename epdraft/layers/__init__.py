"""Draft FFN layers: router, routed experts, dense MLP, DraftMoE, and the rank's StepKernels.

Shape legend used in names across epdraft (`x_TH`, `w13_eNH`):
    T tokens on this rank          H hidden size
    E experts in the layer         e experts held by this rank
    K top-k                        I per-expert intermediate size
    F intermediate slice held here (I / moe_tp); N = 2F (gate and up stacked)
    R rows after dispatch          S shared-expert intermediate size
"""

from epdraft.layers.build import build_ffn
from epdraft.layers.mlp import DraftMLP
from epdraft.layers.moe import DraftMoE
from epdraft.layers.routed_experts import RoutedExperts, experts_fn
from epdraft.layers.router import Router
from epdraft.layers.step_kernels import StepKernels

__all__ = ["DraftMLP", "DraftMoE", "RoutedExperts", "Router", "StepKernels", "build_ffn", "experts_fn"]
