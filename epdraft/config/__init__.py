"""Configuration: draft FFN specs from HF configs, the parallel layout, a request's sampling; all validation lives here."""

from epdraft.config.ffn import (
    ActivationSpec,
    DraftDenseFFNSpec,
    DraftMoeFFNSpec,
    FFNSpec,
    RouterSpec,
)
from epdraft.config.hf import DraftMixFFNSpec
from epdraft.config.quant import QuantSpec, parse_quantization_config
from epdraft.config.sampling import SamplingParams, parse_sampling
from epdraft.config.parallel import (
    ClusterConfig,
    DraftConfig,
    ParallelConfig,
    PlacementConfig,
    TargetConfig,
    apply_overrides,
    load_parallel_config,
    parallel_config_from_dict,
)

__all__ = [
    "ActivationSpec",
    "ClusterConfig",
    "DraftConfig",
    "DraftDenseFFNSpec",
    "DraftMixFFNSpec",
    "DraftMoeFFNSpec",
    "FFNSpec",
    "ParallelConfig",
    "PlacementConfig",
    "QuantSpec",
    "SamplingParams",
    "RouterSpec",
    "TargetConfig",
    "apply_overrides",
    "load_parallel_config",
    "parallel_config_from_dict",
    "parse_quantization_config",
    "parse_sampling",
]
