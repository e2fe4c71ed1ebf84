"""epdraft: MoE speculative-decoding drafts under DP attention + expert parallelism.

`DraftRuntime` is what a serving engine embeds (see `epdraft.runtime`); the rest lives in the
subpackages: config, layers, kernels, loading, dispatch, models, target, worker.
"""

from epdraft.runtime import DraftRuntime, Proposal

__all__ = ["DraftRuntime", "Proposal"]
__version__ = "0.1.0"
