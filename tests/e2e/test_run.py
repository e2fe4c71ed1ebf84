"""`epdraft run` end to end on CPU ranks: lossless, and the tiny pair's acceptance holds in every layout.

A wrong dispatch or combine corrupts the draft's MoE output, which collapses the accept length
(tokens per verify step, bonus included) toward 1 while staying lossless (the target decides), so acceptance is the check
that the distributed MoE computes the right thing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.harness import free_port

CASES = {
    "1rank-replicated": ["--set", "cluster.nproc_per_node=1", "--set", "draft.attn_dp=1", "--set", "target.dp=1",
                         "--set", "draft.moe_layout=replicated", "--set", "draft.moe_ep=1"],
    "2rank-alltoall": [],
    "2rank-gather-sum_len": ["--set", "draft.moe_layout=gather", "--set", "draft.dp_padding=sum_len"],
    "4rank-replicated": ["configs/local-cpu-4.toml", "--set", "draft.moe_layout=replicated",
                         "--set", "draft.moe_ep=1", "--set", "draft.moe_tp=1"],
    "4rank-alltoall-ep4": ["configs/local-cpu-4.toml", "--set", "draft.moe_layout=alltoall",
                           "--set", "draft.moe_ep=4", "--set", "draft.moe_tp=1"],
    "4rank-gather-ep2-tp2": ["configs/local-cpu-4.toml", "--set", "draft.moe_layout=gather",
                             "--set", "draft.moe_ep=2", "--set", "draft.moe_tp=2"],
}


def run_epdraft(args: list[str], tmp_path, timeout: float = 400) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "epdraft.cli", "run", *args, "--json", str(out), "--master-port", str(free_port())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def _env():
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", list(CASES))
def test_run_is_lossless_and_accepts(case, tmp_path):
    # 5 prompts over 4 ranks (or 2): counts are uneven, so ranks go idle at different steps.
    proc, summary = run_epdraft([*CASES[case], "--max-prompts", "5", "--max-new-tokens", "32"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary is not None and summary["lossless"] is True, proc.stdout
    assert summary["requests"] == 5 and not summary["failed_requests"]
    assert summary["accept_length"] >= 2.0, proc.stdout
    assert "lossless: OK" in proc.stdout
