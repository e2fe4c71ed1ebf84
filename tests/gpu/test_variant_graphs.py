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
from epdraft.dispatch import StepPlan
from epdraft.models import load_draft
from epdraft.runtime.graphs import StepGraphs
from tests.e2e.test_variants import VARIANTS

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
CASES = {"dflash": [], **VARIANTS}


@torch.no_grad()
@pytest.mark.parametrize("variant", sorted(CASES))
def test_variant_graph_replay_equals_eager(variant, tmp_path):
    made = subprocess.run([sys.executable, str(REPO / "tools" / "make_variant_draft.py"), str(tmp_path / "pair"),
                           *CASES[variant]], capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert made.returncode == 0, made.stderr
    draft = load_draft(tmp_path / "pair" / "draft", dtype=torch.bfloat16, device="cuda").eval()
    spec, B, n, bucket = draft.spec, draft.block_size, 3, 4
    heads = RandomHeads(spec.vocab_size, spec.hidden_size, dtype=torch.bfloat16, device=torch.device("cuda"))
    width = spec.num_target_features * spec.hidden_size
    pool = draft.new_pool(max_requests=bucket, max_context=20 * B + 64)
    rids = list(range(n))
    for rid in rids:
        pool.admit(rid)
    gen = torch.Generator(device="cuda").manual_seed(3)
    draft.extend_pool(pool, rids, [torch.randn(5 + 7 * i, width, generator=gen, device="cuda").bfloat16() for i in rids])
    graphs = StepGraphs(
        lambda s, a, plan: draft.propose_pooled(pool, s, a, heads, plan), pad_slot=pool.pad_slot,
        buckets=(bucket,), block_size=B, device=torch.device("cuda"),
    )  # fmt: skip
    slots = [pool.slot(r) for r in rids]
    slots_N = torch.tensor(slots + [pool.pad_slot] * (bucket - n), device="cuda")  # eager on the graph's shapes
    anchors = torch.randint(0, spec.vocab_size - 1, (n,), generator=gen, device="cuda")
    mismatches = 0
    for step in range(20):
        plan = StepPlan(step=step, ranks=(0,), counts=(n * B,))
        eager, finite = draft.propose_pooled(pool, slots_N, torch.cat([anchors, anchors.new_zeros(bucket - n)]), heads, plan)
        anchor_list = anchors.tolist()
        torch.cuda.set_sync_debug_mode("error")
        try:
            replayed, replayed_finite = graphs.run(slots, anchor_list, plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        mismatches += int(not torch.equal(replayed, eager[:n])) + int(not torch.equal(replayed_finite, finite))
        assert bool(finite.all()), f"step {step}: a layer went non-finite"
        commit = [1 + (step + i) % B for i in rids]
        draft.extend_pool(pool, rids, [torch.randn(c, width, generator=gen, device="cuda").bfloat16() for c in commit])
        anchors = eager[:n, 0]
    assert mismatches == 0
