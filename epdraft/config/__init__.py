"""Configuration: draft FFN specs from HF configs and the parallel layout; all validation lives here."""

from epdraft.config.ffn import (
    ActivationSpec,
    DraftDenseFFNSpec,
    DraftMixFFNSpec,
    DraftMoeFFNSpec,
    FFNSpec,
    RouterSpec,
)

__all__ = [
    "ActivationSpec",
    "DraftDenseFFNSpec",
    "DraftMixFFNSpec",
    "DraftMoeFFNSpec",
    "FFNSpec",
    "RouterSpec",
]
