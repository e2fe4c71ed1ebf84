"""Draft models: DFlash / DSpark assembled from a DraftModelSpec, their step over a KV pool, SpecForge export
loading, the single-process decode loop; `reference` holds the cache-based oracle of the step."""

from epdraft.models.checkpoint import load_draft, load_draft_weights, read_draft_spec
from epdraft.models.dflash import DFlashDraft, TargetHeads
from epdraft.models.dspark import DSparkDraft
from epdraft.models.protocol import DRAFT_FAMILIES, DraftModel
from epdraft.models.spec import DraftModelSpec, check_against_target
from epdraft.models.step import DraftStep
from epdraft.models.speculative import SpeculativeOutput, speculative_generate

__all__ = [
    "DRAFT_FAMILIES",
    "DFlashDraft",
    "DSparkDraft",
    "DraftModel",
    "DraftModelSpec",
    "DraftStep",
    "SpeculativeOutput",
    "TargetHeads",
    "check_against_target",
    "load_draft",
    "load_draft_weights",
    "read_draft_spec",
    "speculative_generate",
]
