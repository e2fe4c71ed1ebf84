"""Distribution-exact speculative sampling as tensor functions: the requests' logits processed into
probabilities (temperature, top-k, top-p as transformers and vLLM do), counter-based random numbers
keyed by (seed, position, stream), and the rejection walk that turns draft proposals into tokens
distributed exactly as the target's own sampling. No host sync, shapes fixed by the batch: a CUDA
graph can hold them, and an engine that verifies itself can call them as functions.
"""

from epdraft.sampling.probabilities import greedy_probabilities, probabilities
from epdraft.sampling.counter_rng import Stream, uniforms
from epdraft.sampling.batch import Readout, SamplingBatch, request_seed, seeded
from epdraft.sampling.proposal import propose_tokens
from epdraft.sampling.rejection import (
    Verdict,
    greedy_accept,
    rejection_sample,
    sample_tokens,
    speculative_accept,
    verify_drafts,
)

__all__ = [
    "Readout", "SamplingBatch", "Stream", "Verdict", "greedy_accept", "greedy_probabilities", "probabilities",
    "propose_tokens", "rejection_sample", "request_seed", "sample_tokens", "seeded", "speculative_accept", "uniforms",
    "verify_drafts",
]  # fmt: skip
