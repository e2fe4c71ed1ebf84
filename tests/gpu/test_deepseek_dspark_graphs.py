"""A tiny random DeepSeek-V4 / V4.1 DSpark draft (tools/make_deepseek_dspark_draft.py) replayed from a
CUDA graph equals its eager step on one GPU over 100 steps of a growing context (past the window,
so the ring wraps), greedy and sampled, with no host synchronization inside a replay."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epdraft.bench.step import RandomHeads
from epdraft.models import load_draft
from tests.gpu.graph_replay import graph_vs_eager

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]


@torch.no_grad()
@pytest.mark.parametrize("sampling", ["greedy", "sample"])
@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_deepseek_dspark_graph_replay_equals_eager_over_100_steps(variant, sampling, tmp_path):
    flags = ["--v41"] if variant == "v41" else []
    made = subprocess.run([sys.executable, str(REPO / "tools" / "make_deepseek_dspark_draft.py"), str(tmp_path / "draft"),
                           *flags], capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert made.returncode == 0, made.stderr
    draft = load_draft(tmp_path / "draft", dtype=torch.bfloat16, device="cuda").eval()
    assert draft.spec.deepseek.variant == variant
    heads = RandomHeads(draft.spec.vocab_size, draft.spec.hidden_size, dtype=torch.bfloat16, device=torch.device("cuda"))
    mismatches, finite = graph_vs_eager(draft, heads, requests=3, bucket=4, buckets=(4,), steps=100,
                                        first_rows=[2, 7, 19], seed=5, sampling=sampling)  # fmt: skip
    assert mismatches == 0 and finite
