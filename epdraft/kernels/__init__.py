"""Triton kernels on CUDA: the routed experts (`fused_experts`) and their tuned launch configs, the
draft step's block attention (`attention`), its small fused ops (`step_ops`) and its dense
projections at few rows (`skinny`).

Importing this package imports neither Triton nor touches CUDA: each kernels module is loaded the
first time one of its kernels launches.
"""

from epdraft.kernels.fused_moe import fused_experts
from epdraft.kernels.tuning import MoeKernelConfig, get_config

__all__ = ["MoeKernelConfig", "fused_experts", "get_config"]
