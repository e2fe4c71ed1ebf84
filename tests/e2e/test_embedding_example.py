"""docs/embedding.md's example, run as its docstring says: two gloo ranks through torchrun, each
checking its requests against the target's own greedy decode."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_the_embedding_example_runs_lossless_on_two_ranks():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(REPO / "examples" / "embed_cpu.py")],
        capture_output=True, text=True, timeout=280, env=env, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert lines == ["rank 0: 3 requests, lossless: OK", "rank 1: 1 requests, lossless: OK"], proc.stdout
