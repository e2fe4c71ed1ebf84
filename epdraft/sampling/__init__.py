"""Distribution-exact speculative sampling as tensor functions: the requests' logits processed into
probabilities (temperature, top-k, top-p as transformers and vLLM do), counter-based random numbers
keyed by (seed, position, stream), and the rejection walk that turns draft proposals into tokens
distributed exactly as the target's own sampling. No host sync, shapes fixed by the batch: a CUDA
graph can hold them, and an engine that verifies itself can call them as functions.
"""

from epdraft.sampling.probabilities import greedy_probabilities, probabilities
from epdraft.sampling.counter_rng import Stream, uniforms
from epdraft.sampling.rejection import rejection_sample, sample_tokens, verify_drafts

__all__ = ["Stream", "greedy_probabilities", "probabilities", "rejection_sample", "sample_tokens", "uniforms", "verify_drafts"]
