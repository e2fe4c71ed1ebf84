"""epdraft: MoE speculative-decoding drafts under DP attention + expert parallelism.

`DraftRuntime` is what a serving engine embeds (see `epdraft.runtime`); the rest lives in the
subpackages (DESIGN.md's layer order, top down): worker; runtime; parallel, models, target;
layers, dispatch, loading, kernels; config; errors. Importing `epdraft` (or `epdraft.errors`, the
CLI's first import) loads no torch: `DraftRuntime` and `Proposal` are imported on first use.
"""

from typing import TYPE_CHECKING, Any

__all__ = ["DraftRuntime", "Proposal"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from epdraft.runtime import DraftRuntime, Proposal


def __getattr__(name: str) -> Any:
    if name in __all__:
        from epdraft import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'epdraft' has no attribute {name!r}")
