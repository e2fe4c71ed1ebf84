"""Triton kernels for the routed experts on CUDA (`fused_experts`) and their tuned launch configs.

Importing this package imports neither Triton nor touches CUDA: the kernels module is loaded the
first time a kernel launches.
"""

from epdraft.kernels.fused_moe import fused_experts
from epdraft.kernels.tuning import MoeKernelConfig, get_config

__all__ = ["MoeKernelConfig", "fused_experts", "get_config"]
