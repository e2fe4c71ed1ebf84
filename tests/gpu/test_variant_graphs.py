"""Every SpecForge draft variant's step replayed from a CUDA graph equals its eager step on one GPU:
the plain DFlash draft and the DSpark variants of tests/e2e/test_variants.py (Markov heads, the
autoregressive readout, sliding-window layers, hash-routed layers), over 20 steps of a growing
context, with no host synchronization inside a replay. What `draft.cuda_graphs = true` needs of a
draft beyond the preset shape tests/gpu/test_draft_step.py captures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epdraft.bench.step import RandomHeads
from epdraft.models import load_draft
from tests.e2e.test_variants import VARIANTS
from tests.gpu.graph_replay import graph_vs_eager

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
CASES = {"dflash": [], **VARIANTS}


@torch.no_grad()
@pytest.mark.parametrize("sampling", ["greedy", "sample", "filtered"])
@pytest.mark.parametrize("variant", sorted(CASES))
def test_variant_graph_replay_equals_eager(variant, sampling, tmp_path):
    made = subprocess.run([sys.executable, str(REPO / "tools" / "make_variant_draft.py"), str(tmp_path / "pair"),
                           *CASES[variant]], capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert made.returncode == 0, made.stderr
    draft = load_draft(tmp_path / "pair" / "draft", dtype=torch.bfloat16, device="cuda").eval()
    heads = RandomHeads(draft.spec.vocab_size, draft.spec.hidden_size, dtype=torch.bfloat16, device=torch.device("cuda"))
    mismatches, finite = graph_vs_eager(draft, heads, requests=3, bucket=4, buckets=(4,), steps=20,
                                        first_rows=[5, 12, 19], seed=3, sampling=sampling)  # fmt: skip
    assert mismatches == 0 and finite
