"""`epdraft run` samples exactly: its first three tokens are distributed as the target's own sampling.

Compared: the first three generated tokens of M seeded requests of one prompt (`reference_prompt()`)
against their exact distribution under ancestral sampling from the tiny target with transformers'
warpers (tests/sampling/exact.py, independent of epdraft.sampling), by Pearson's chi-square at
alpha = 1e-4, for two settings in one run (per-request parameters): T = 1.0 over the full vocabulary
and T = 0.7 with top_k = 5. Each request carries its own seed (its index) and the runner's random
numbers are counter-based, keyed by (seed, position), so a run's tokens depend on the requests, not
on timing or batching: the test gives the same statistic every time, and alpha bounds the chance that
a change of model, seeds or build fails a correct sampler (1 in 10,000 per comparison), not flakiness.

`test_biased_verifier_fails` shows the test has power against the bug it is for: a speculative
verifier that is wrong in a way easy to miss, run in-process on the same target, fails it, and the
correct walk (`epdraft.sampling.rejection_sample`) on the same inputs passes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from epdraft.sampling import rejection_sample, sample_tokens
from tests.harness import free_port
from tests.sampling.exact import (
    chi_square,
    chi_square_threshold,
    load_target,
    next_token_logits,
    reference_prompt,
    tiny_reference,
    warped_probabilities,
)

M = 3000  # requests per setting
SETTINGS = [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 5}]  # one run, per-request parameters
ONE_RANK = ["--set", "cluster.nproc_per_node=1", "--set", "draft.attn_dp=1", "--set", "target.dp=1",
            "--set", "draft.moe_layout=replicated", "--set", "draft.moe_ep=1"]  # fmt: skip
CASES = {"1rank": ONE_RANK, "2rank-alltoall": [], "2rank-gather": ["--set", "draft.moe_layout=gather"]}


def check_counts(counts: Counter, n: int, temperature: float, top_k: int | None = None) -> None:
    """Assert that `counts` of n three-token sequences pass the chi-square test against the exact
    distribution, naming the statistic, the degrees of freedom and the threshold."""
    statistic, dof = chi_square(counts, tiny_reference(temperature, top_k), n)
    threshold = chi_square_threshold(dof)
    setting = f"T {temperature} top_k {top_k}"
    assert statistic < threshold, f"{setting}: chi-square {statistic:.1f} >= {threshold:.1f} ({dof} dof)"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(CASES))
def test_run_samples_exactly(case, tmp_path):
    prompt = reference_prompt()
    lines = [{"id": s * M + i, "input_ids": prompt, **params, "seed": s * M + i}
             for s, params in enumerate(SETTINGS) for i in range(M)]  # fmt: skip
    prompts, out, summary = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl", tmp_path / "summary.json"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cmd = [sys.executable, "-m", "epdraft.cli", "run", *CASES[case], "--prompts", str(prompts), "--max-new-tokens", "3",
           "--output", str(out), "--json", str(summary), "--no-lossless-check", "--master-port", str(free_port())]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=850, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Some drafts must be kept, or only the rejection branch of the walk was tested (the first token
    # comes from prefill; tokens 2 and 3 from verify steps).
    assert json.loads(summary.read_text())["accept_length"] > 1.0, proc.stdout
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in results] == [line["id"] for line in lines]
    assert all(len(r["output_ids"]) == 3 for r in results), results[0]
    for s, params in enumerate(SETTINGS):
        counts = Counter(tuple(r["output_ids"]) for r in results[s * M : (s + 1) * M])
        check_counts(counts, M, params["temperature"], params.get("top_k"))


# In-process speculative decoding with biased and correct verifiers: p is the target at T = 1.0, the
# proposal q the target at T = 1.3 (close to p, as a trained draft is, so a bias shows only in the
# statistics). Each walk drafts K = 3 tokens from q and verifies them against p; a request's walks
# repeat from its tokens so far until it has 3 (one walk when it accepts 2 or more drafts).

N, K = 4000, 3
Walk = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]  # as rejection_sample


def accept_argmax(draft_NK: Tensor, q_NKV: Tensor, p_NKV: Tensor, accept_u_NK: Tensor, target_u_NK: Tensor
                  ) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Biased: greedy verification on a sampled request (a draft is kept when it is p's argmax),
    the token after drawn from p."""
    accepted = (draft_NK == p_NKV[:, :K].argmax(dim=-1)).long().cumprod(dim=-1).sum(dim=-1)
    p_N = p_NKV[torch.arange(len(draft_NK)), accepted]
    return accepted, sample_tokens(p_N, target_u_NK.gather(1, accepted.unsqueeze(1)).squeeze(1))


def no_residual(draft_NK: Tensor, q_NKV: Tensor, p_NKV: Tensor, accept_u_NK: Tensor, target_u_NK: Tensor
                ) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Biased: the accept test min(1, p/q) is right, but a rejected position's token is drawn
    from p instead of the residual max(0, p - q)."""
    p_x = p_NKV[:, :K].gather(-1, draft_NK.unsqueeze(-1)).squeeze(-1)
    q_x = q_NKV.gather(-1, draft_NK.unsqueeze(-1)).squeeze(-1)
    accepted = (accept_u_NK * q_x < p_x).long().cumprod(dim=-1).sum(dim=-1)
    p_N = p_NKV[torch.arange(len(draft_NK)), accepted]
    return accepted, sample_tokens(p_N, target_u_NK.gather(1, accepted.unsqueeze(1)).squeeze(1))


def speculative_counts(walk: Walk, seed: int) -> Counter:
    """Counts of the first 3 tokens of N requests decoded by `walk` from the tiny target."""
    model, prompt = load_target(), reference_prompt()
    gen = torch.Generator().manual_seed(seed)
    tokens = [[] for _ in range(N)]
    while short := [n for n in range(N) if len(tokens[n]) < 3]:
        for length in sorted({len(tokens[n]) for n in short}):  # a batched forward needs equal lengths
            rows = [n for n in short if len(tokens[n]) == length]
            prefix_BL = torch.tensor([tokens[n] for n in rows], dtype=torch.long).view(len(rows), length)
            q, p = [], []
            for i in range(K + 1):  # the target after each draft prefix; the draft samples K of them
                logits_BV = next_token_logits(model, prompt, prefix_BL)
                p.append(warped_probabilities(logits_BV, temperature=1.0))
                if i < K:
                    q.append(warped_probabilities(logits_BV, temperature=1.3))
                    prefix_BL = torch.cat([prefix_BL, torch.multinomial(q[-1], 1, generator=gen)], dim=1)
            draft_BK = prefix_BL[:, length:]
            u = torch.rand(len(rows), 2 * K + 1, generator=gen, dtype=torch.float64)
            accepted, token = walk(draft_BK, torch.stack(q, dim=1), torch.stack(p, dim=1), u[:, :K], u[:, K:])
            for b, n in enumerate(rows):
                tokens[n] += draft_BK[b, : accepted[b]].tolist() + [int(token[b])]
    return Counter(tuple(t[:3]) for t in tokens)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("walk", [accept_argmax, no_residual], ids=["accept-argmax", "no-residual"])
def test_biased_verifier_fails(walk):
    statistic, dof = chi_square(speculative_counts(walk, seed=0), tiny_reference(1.0), N)
    assert statistic > chi_square_threshold(dof), (statistic, dof)


@pytest.mark.timeout(300)
def test_rejection_sample_passes():
    """The biased walks' inputs (target, proposal, seed) through epdraft's walk: it passes."""
    check_counts(speculative_counts(rejection_sample, seed=0), N, 1.0)
