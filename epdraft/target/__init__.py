"""The target side: the Target protocol, verify results, and the HF transformers implementation.

`epdraft.target.hf.HFTarget` is imported from its module (it needs transformers).
"""

from epdraft.target.base import PrefillResult, Target, VerifyResult, greedy_accept, validate_prompt

__all__ = ["PrefillResult", "Target", "VerifyResult", "greedy_accept", "validate_prompt"]
