"""The one-launch sampled readout (`kernels.sample.propose`) against the torch chain it replaces
(`epdraft.sampling.propose_tokens` on its tensor ops): the same uniforms bit for bit (the hash is
integer arithmetic), q to a few fp32 ulps (the GPU's exp), the same tokens; greedy rows one-hot at
the first maximum; and the draws distributed as q (chi-square, fixed seeds). The Markov head's
greedy argmax without logits (`kernels.sample.markov_argmax`) against the fp32 logits' argmax."""

from __future__ import annotations

import pytest
import torch

from epdraft.config.sampling import SamplingParams
from epdraft.kernels.sample.argmax import argmax_rows
from epdraft.kernels.sample.markov_argmax import markov_argmax
from epdraft.kernels.sample.propose import propose_sampled
from epdraft.sampling import SamplingBatch, Stream, propose_tokens
from tests.sampling.exact import chi_square, chi_square_threshold

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("V", [32000, 129280, 300])
def test_kernel_equals_the_torch_chain(dtype, V):
    gen = torch.Generator(device="cuda").manual_seed(V)
    N, k = 37, 15
    logits = (torch.randn(N, k, V, generator=gen, device="cuda") * 4).to(dtype)
    logits[3, 2, 7] = logits[3, 2, 11] = logits[3, 2].max() + 1  # a tie: the first maximum wins
    temps = [0.0 if n % 5 == 3 else (0.3, 0.8, 1.0, 1.7)[n % 4] for n in range(N)]
    params = [SamplingParams(temperature=t, seed=(n * 2**40 + 12345) if t else None) for n, t in enumerate(temps)]
    batch = SamplingBatch.of(params, "cuda")
    first = torch.tensor([n * 2**31 + 3 for n in range(N)], device="cuda")
    tokens, q = propose_sampled(logits, batch.temperature, batch.seed, first, int(Stream.DRAFT))
    ref_tokens, ref_q = propose_tokens(logits, batch, first)
    # the GPU's exp (ex2.approx) differs from torch's by a few fp32 ulps; what is drawn is the stored q
    torch.testing.assert_close(q, ref_q, rtol=1e-5, atol=1e-7)
    assert int(tokens[3, 2]) == 7
    same = (tokens == ref_tokens).float().mean().item()
    # a token may differ only where u falls within the exp's rounding of a CDF step: over V terms the
    # CDF moves by ~1e-6, so a few rows in a thousand (0.18 % seen at V 32000)
    assert same >= 0.99, same
    assert torch.equal(q.sum(dim=-1).round(), torch.ones(N, k, device="cuda"))


def test_kernel_draws_follow_q():
    V, n = 300, 20000
    gen = torch.Generator(device="cuda").manual_seed(0)
    row = torch.randn(V, generator=gen, device="cuda") * 2
    logits = row.expand(n, 1, V).contiguous()
    temperature = torch.full((n,), 0.9, device="cuda")
    tokens, q = propose_sampled(logits, temperature, torch.arange(n, device="cuda"), torch.zeros(n, dtype=torch.long,
                                device="cuda"), int(Stream.DRAFT))  # fmt: skip
    probs = {(t,): float(p) for t, p in enumerate(q[0, 0].double().cpu())}
    counts: dict[tuple[int, ...], int] = {}
    for t in tokens[:, 0].tolist():
        counts[(t,)] = counts.get((t,), 0) + 1
    stat, dof = chi_square(counts, probs, n)
    assert stat < chi_square_threshold(dof), (stat, dof)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,V,R", [(1, 129280, 256), (64, 129280, 256), (5, 300, 8), (0, 300, 8)])
def test_markov_argmax_equals_the_logits_argmax(dtype, N, V, R):
    """Every row's token is the fp32 logits' argmax, or (rounding of the sum's order) a token whose
    logit is within 1e-4 of the maximum; an exact tie goes to the first token."""
    gen = torch.Generator(device=DEVICE).manual_seed(N + V)
    base = (torch.randn(N, 3, V, generator=gen, device=DEVICE) * 4).to(dtype)[:, 1]  # a strided view, as decode passes
    latent = torch.randn(N, R, generator=gen, device=DEVICE)
    w2 = (torch.randn(V, R, generator=gen, device=DEVICE) * R**-0.5).to(dtype)
    if N > 3:
        base[3, 7] = base[3, 11] = 1e4  # far above the rest: an exact tie of the two logits' maxima...
        w2[7], w2[11] = w2[11].clone(), w2[11].clone()  # ...with the same weight rows
    logits = base.float() + latent @ w2.float().T
    got = markov_argmax(base, latent, w2)
    assert got.dtype == torch.long and got.shape == (N,)
    picked = logits.gather(1, got.unsqueeze(1)).squeeze(1)
    assert bool((picked >= logits.max(dim=1).values - 1e-4).all())
    assert (got == logits.argmax(dim=1)).float().mean() >= 0.99 if N else True
    if N > 3:
        assert int(got[3]) == 7


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("N,V", [(1, 32000), (15, 32000), (960, 32000), (7, 129280), (3, 2049), (2, 5), (0, 300)])
def test_argmax_rows_equals_torch_argmax(dtype, N, V):
    """torch.argmax's tokens bit for bit: coarse bf16 logits (many exact ties, the first wins), a
    strided view, a row of -inf but one token, a maximum tied across vocabulary blocks, -inf rows."""
    gen = torch.Generator(device=DEVICE).manual_seed(N * 7 + V)
    logits = (torch.randn(N, 2 * V, generator=gen, device=DEVICE) * 3).round().to(dtype)[:, ::2]
    if N >= 3:
        logits[0] = float("-inf")
        logits[1] = float("-inf")
        logits[1, V - 1] = 0.0
        logits[2, V - 1] = logits[2, 0] = logits[2].max() + 1  # the same maximum in the first and last blocks
    got = argmax_rows(logits)
    assert got.dtype == torch.long and got.shape == (N,)
    assert torch.equal(got, logits.argmax(dim=-1))
