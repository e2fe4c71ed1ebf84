"""Draft models: DFlash / DSpark assembled from a DraftModelSpec, SpecForge export loading, reference decode loop."""

from epdraft.models.cache import DraftCache
from epdraft.models.checkpoint import load_draft, load_draft_weights, read_draft_spec
from epdraft.models.dflash import DFlashDraft, TargetHeads
from epdraft.models.dspark import DSparkDraft
from epdraft.models.protocol import DRAFT_FAMILIES, DraftModel
from epdraft.models.spec import DraftModelSpec, check_against_target
from epdraft.models.speculative import SpeculativeOutput, speculative_generate

__all__ = [
    "DRAFT_FAMILIES",
    "DFlashDraft",
    "DSparkDraft",
    "DraftCache",
    "DraftModel",
    "DraftModelSpec",
    "SpeculativeOutput",
    "TargetHeads",
    "check_against_target",
    "load_draft",
    "load_draft_weights",
    "read_draft_spec",
    "speculative_generate",
]
