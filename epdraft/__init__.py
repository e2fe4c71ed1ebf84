"""epdraft: MoE speculative-decoding drafts under DP attention + expert parallelism."""

__version__ = "0.1.0"
