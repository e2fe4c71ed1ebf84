"""`epdraft run` with a tiny random DeepSeek-V4 DSpark draft (tools/make_deepseek_dspark_draft.py) on
1 CPU rank (replicated) and 2 (alltoall, gather, replicated): lossless, every request served, and
with sampled requests too (the sampled readout through the Markov head); the V4.1 variant (`--v41`)
on the same four layouts. DeepSeek's released layout (issue 32): `--draft` at a tiny
DeepSeek-V4-layout target checkpoint bundling the draft under `mtp.*` (FP8 linears, FP4 experts;
`--bundle`), V4 and V4.1 (32 x 32 blocks), on 1 rank and 2 ranks alltoall; the ranks load it with
`load_draft`, whose reads tests/models/test_deepseek_checkpoint.py counts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_run import CASES, run_epdraft

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = ["1rank-replicated", "2rank-alltoall", "2rank-gather-sum_len", "2rank-replicated"]
VARIANT_LAYOUTS = [(variant, layout) for variant in ("v4", "v41") for layout in LAYOUTS]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant, layout", VARIANT_LAYOUTS)
def test_deepseek_dspark_run_is_lossless(variant, layout, tmp_path):
    flags = ["--v41"] if variant == "v41" else []
    tool = REPO / "tools" / "make_deepseek_dspark_draft.py"
    made = subprocess.run([sys.executable, str(tool), str(tmp_path / "draft"), *flags],
                          capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert made.returncode == 0, made.stderr
    args = [*CASES[layout], "--draft", str(tmp_path / "draft"), "--max-prompts", "3", "--max-new-tokens", "16"]
    proc, summary = run_epdraft(args, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary is not None and summary["lossless"] is True, proc.stdout
    assert summary["requests"] == 3 and not summary["failed_requests"]
    assert summary["generated_tokens"] == 3 * 16


@pytest.mark.timeout(300)
def test_deepseek_dspark_samples(tmp_path):
    made = subprocess.run([sys.executable, str(REPO / "tools" / "make_deepseek_dspark_draft.py"), str(tmp_path / "draft")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert made.returncode == 0, made.stderr
    args = ["--draft", str(tmp_path / "draft"), "--max-prompts", "3", "--max-new-tokens", "16", "--temperature", "0.8"]
    proc, summary = run_epdraft(args, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary is not None and summary["generated_tokens"] == 3 * 16 and not summary["failed_requests"]
    assert "T=0.8" in proc.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant, layout", [("v4", "1rank-replicated"), ("v4", "2rank-alltoall"),
                                             ("v41", "2rank-alltoall")])
def test_deepseek_released_layout_bundled_in_a_target_checkpoint_is_lossless(variant, layout, tmp_path):
    flags = ["--bundle"] + (["--v41"] if variant == "v41" else [])
    made = subprocess.run([sys.executable, str(REPO / "tools" / "make_deepseek_dspark_draft.py"), str(tmp_path / "ckpt"),
                           *flags], capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    args = [*CASES[layout], "--draft", str(tmp_path / "ckpt"), "--max-prompts", "3", "--max-new-tokens", "16"]
    proc, summary = run_epdraft(args, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary is not None and summary["lossless"] is True, proc.stdout
    assert summary["requests"] == 3 and not summary["failed_requests"] and summary["generated_tokens"] == 3 * 16
    output = proc.stdout + proc.stderr
    assert "a target checkpoint bundling the draft" in output
    logged = [line for line in output.splitlines() if "dequantized to float32 at load" in line]
    assert len(logged) == 1 and "fp4 checkpoint dequantized" in logged[0] and "fp8 linears" in logged[0], logged
