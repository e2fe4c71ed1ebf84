"""`epdraft run` with a fault installed in its workers (tests/e2e/faults/sitecustomize.py wraps an
epdraft method to inject it), watched line by line: what the fault tests share."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.harness import free_port

REPO = Path(__file__).resolve().parents[2]
FAULTS = Path(__file__).resolve().parent / "faults"


@dataclasses.dataclass(frozen=True)
class FaultyRun:
    returncode: int
    stderr: str
    seen_at: float | None  # time.monotonic() when `seen` first appeared on stderr (None: never)
    ended_at: float  # time.monotonic() when the command had exited
    marker: str  # in every process's environment: `processes_with(marker)` finds leftovers


def run_with_fault(fault_env: dict[str, str], args: list[str], seen: str) -> FaultyRun:
    """`epdraft run ARGS --master-port P` with `fault_env` (the fault's variables) in every
    process's environment and the fault injection on PYTHONPATH; stdout dropped, stderr kept."""
    marker = uuid.uuid4().hex
    pythonpath = os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **fault_env, "EPDRAFT_TEST_MARKER": marker, "PYTHONPATH": pythonpath}
    cmd = [sys.executable, "-m", "epdraft.cli", "run", *args, "--master-port", str(free_port())]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen_at, lines = None, []
    for line in proc.stderr:
        lines.append(line)
        if seen_at is None and seen in line:
            seen_at = time.monotonic()
    returncode = proc.wait(timeout=60)
    return FaultyRun(returncode, "".join(lines), seen_at, time.monotonic(), marker)


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose environment carries `marker` (a run's launch and its children)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"EPDRAFT_TEST_MARKER={marker}".encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found
