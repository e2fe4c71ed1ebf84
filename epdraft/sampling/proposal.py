"""The draft's side of speculative sampling: tokens drawn from the processed draft logits, and the
proposal distribution q they were drawn from (what the verifier's accept test and residual need)."""

from __future__ import annotations

import torch

from epdraft.kernels.sample.propose import propose_sampled
from epdraft.sampling.batch import Readout, SamplingBatch
from epdraft.sampling.counter_rng import Stream, uniforms
from epdraft.sampling.rejection import sample_tokens


def propose_tokens(
    logits_NkV: torch.Tensor, batch: SamplingBatch, first_N: torch.Tensor, *, fused: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [N, k] int64, q [N, k, V] fp32): each row's logits processed with its request's
    temperature / top-k / top-p (one-hot argmax on greedy rows), sampled with the DRAFT stream of
    (seed, position), token i of request n deciding sequence position first_N[n] + i. k may be 1
    for a draft that proposes position by position (a Markov head).

    fused: the rank's `StepKernels.sampling` is "triton": a batch without top-k / top-p
    (`Readout.SAMPLE`) is drawn in one launch (`kernels.sample.propose`, the same numbers).
    """
    if fused and batch.readout is Readout.SAMPLE:
        return propose_sampled(logits_NkV, batch.temperature, batch.seed, first_N, int(Stream.DRAFT))
    positions_Nk = first_N.unsqueeze(1) + torch.arange(logits_NkV.shape[1], device=logits_NkV.device)
    q_NkV = batch.probabilities(logits_NkV)
    u_Nk = uniforms(batch.seed.unsqueeze(1), positions_Nk, Stream.DRAFT)
    return sample_tokens(q_NkV, u_Nk), q_NkV
