"""`epdraft run` with a tiny random draft of every SpecForge variant, on 1 and 2 CPU ranks: lossless.

Variants (tools/make_variant_draft.py): DSpark rnn head + autoregressive readout + sliding-window
layers + a hash-routed first layer, against a target with sliding-window layers; DSpark gated head +
mask-filling readout + a confidence head without Markov input; DSpark vanilla + two hash layers.
The hash layers run under alltoall and gather (experts sharded over both ranks, ranks going idle as
their prompts finish). Random drafts are rarely accepted: the check is losslessness, and that every
rank's draft ran (a failing variant stops the run).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_run import CASES, run_epdraft

REPO = Path(__file__).resolve().parents[2]
VARIANTS = {
    "rnn-ar-sliding-hash": ["--markov", "rnn", "--autoregressive", "--sliding-window", "3", "--hash-layers", "1",
                            "--sliding-target", "4"],
    "gated-maskfill-conf": ["--markov", "gated", "--no-confidence-markov", "--sliding-window", "9"],
    "vanilla-hash2": ["--markov", "vanilla", "--hash-layers", "2", "--autoregressive"],
}
LAYOUTS = {
    "1rank": CASES["1rank-replicated"],
    "2rank-alltoall": CASES["2rank-alltoall"],
    "2rank-gather": CASES["2rank-gather-sum_len"],
}
RUNS = [
    ("rnn-ar-sliding-hash", "1rank"),
    ("rnn-ar-sliding-hash", "2rank-alltoall"),
    ("rnn-ar-sliding-hash", "2rank-gather"),
    ("gated-maskfill-conf", "1rank"),
    ("gated-maskfill-conf", "2rank-alltoall"),
    ("vanilla-hash2", "2rank-gather"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant, layout", RUNS, ids=[f"{v}-{l}" for v, l in RUNS])
def test_variant_run_is_lossless(variant, layout, tmp_path):
    made = subprocess.run([sys.executable, str(REPO / "tools" / "make_variant_draft.py"), str(tmp_path / "pair"),
                           *VARIANTS[variant]], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert made.returncode == 0, made.stderr
    target = tmp_path / "pair" / "target"
    args = ["--draft", str(tmp_path / "pair" / "draft"), *(["--target", str(target)] if target.exists() else [])]
    proc, summary = run_epdraft([*LAYOUTS[layout], *args, "--max-prompts", "3", "--max-new-tokens", "20"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary is not None and summary["lossless"] is True, proc.stdout
    assert summary["requests"] == 3 and not summary["failed_requests"]
    assert summary["generated_tokens"] == 3 * 20


@pytest.mark.timeout(420)
def test_autoregressive_variant_runs_disaggregated(tmp_path):
    """B drafts per step (verify width B + 1) travel between draft and target nodes as well."""
    made = subprocess.run([sys.executable, str(REPO / "tools" / "make_variant_draft.py"), str(tmp_path / "pair"),
                           *VARIANTS["rnn-ar-sliding-hash"]], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert made.returncode == 0, made.stderr
    pair = tmp_path / "pair"
    proc, summary = run_epdraft(["configs/local-cpu-disagg.toml", "--draft", str(pair / "draft"), "--target",
                                 str(pair / "target"), "--max-prompts", "3", "--max-new-tokens", "20"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary is not None and summary["lossless"] is True and summary["generated_tokens"] == 60, proc.stdout
