"""The README's commands run as written: every `epdraft ...` line of its bash blocks is run (with
small sizes for `epdraft run`, a free port for a fixed one) or skipped for a reason this test names
(GPUs, other hosts). A README line the test does not know fails it: a new command gets a case."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epdraft.worker.transfer.mooncake import unavailable_reason as mooncake_unavailable_reason
from tests.harness import free_port

REPO = Path(__file__).resolve().parents[1]
SMALL_RUN = ["--max-prompts", "2", "--max-new-tokens", "8"]
# README line (comment and trailing `&` stripped) -> why it is not run here, or None: run it.
SKIPS = {
    "epdraft launch configs/h200x8-dp8-ep8.toml": "needs 8 GPUs" if torch.cuda.device_count() < 8 else None,
    "epdraft launch configs/2node-h200x16-dp16-ep16.toml --node-rank 0 --master-addr node0 --master-port 29500":
        "needs a host named node0 and 16 GPUs",
    "epdraft launch configs/2node-h200x16-dp16-ep16.toml --node-rank 1 --master-addr node0 --master-port 29500":
        "needs a host named node0 and 16 GPUs",
    "epdraft run configs/local-cpu-disagg.toml --set placement.transfer=mooncake": mooncake_unavailable_reason(),
}  # fmt: skip


def readme_commands() -> list[list[str]]:
    """Each bash block's `epdraft` lines, grouped: lines ending in `&` run together with the next."""
    text = (REPO / "README.md").read_text()
    groups, pending = [], []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            command = line.split(" #")[0].strip()
            if "epdraft " not in command:
                continue
            command = command[command.index("epdraft "):]  # after `pip install ... &&`
            pending.append(command.rstrip("&").strip())
            if not command.endswith("&"):
                groups.append(pending)
                pending = []
    return groups


def _argv(command: str, port: int) -> list[str]:
    argv = shlex.split(command)
    argv = [str(port) if i and argv[i - 1] == "--master-port" else a for i, a in enumerate(argv)]
    if argv[1] == "run":
        argv += SMALL_RUN
        if "--master-port" not in argv:
            argv += ["--master-port", str(port)]
    return [sys.executable, "-m", "epdraft.cli", *argv[1:]]


def test_every_readme_command_has_a_case():
    commands = [c for group in readme_commands() for c in group]
    assert "epdraft run" in commands and len(commands) >= 8, commands
    assert set(SKIPS) <= set(commands), set(SKIPS) - set(commands)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("group", readme_commands(), ids=lambda g: " & ".join(g))
def test_readme_command_runs_as_written(group):
    reasons = [SKIPS[c] for c in group if SKIPS.get(c)]
    if reasons:
        pytest.skip(reasons[0])
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(_argv(c, port), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for c in group]  # fmt: skip
    try:
        outs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for command, p, out in zip(group, procs, outs):
        assert p.returncode == 0, f"{command}:\n{out}"
        if command.startswith("epdraft run"):
            assert "lossless: OK" in out, f"{command}:\n{out}"
