"""Rank failures as files: a failing rank writes its one-line reason, the launcher prints the first.

Every rank of a failing run has something to say (the one that failed, and each peer that lost
it), and torchrun adds its own traceback; the user needs the first reason once. The launcher
passes the workers a folder (`--failure-dir`); each failing rank writes `rank-R.json` there
before it exits, and the launcher reads the earliest. Each rank also keeps its last step and
phase there (`progress-R.json`, rewritten when they change, at most once a heartbeat), so a rank
killed before it could say anything is still named with where it was. Torch-free: the launcher
imports it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec


class RankFailure(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's reason for failing.

    exit_code: 2 when the rank refused its input (config, draft, target, prompts), 1 for a fault.
    at: wall-clock seconds when it was written (ranks of one host share the clock; the launcher
    only compares the failures of its own host).
    """

    rank: int
    exit_code: int
    message: str
    at: float


class RankProgress(msgspec.Struct, frozen=True, kw_only=True):
    """Where a rank last was, as its heartbeat saw it."""

    rank: int
    step: int
    phase: str

    @property
    def where(self) -> str:
        return f"step {self.step}, phase {self.phase}" if self.step >= 0 else f"phase {self.phase}"


def write_progress(folder: str | Path, rank: int, step: int, phase: str) -> None:
    """Replace this rank's progress file atomically."""
    path = Path(folder) / f"progress-{rank}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(msgspec.json.encode(RankProgress(rank=rank, step=step, phase=phase)))
    os.replace(tmp, path)


def read_progress(folder: str | Path) -> dict[int, RankProgress]:
    """Every rank's last progress in `folder`, by rank."""
    found = {}
    for path in Path(folder).glob("progress-*.json"):
        try:
            p = msgspec.json.decode(path.read_bytes(), type=RankProgress)
        except (OSError, msgspec.DecodeError):
            continue
        found[p.rank] = p
    return found


def write_failure(folder: str | Path, rank: int, exit_code: int, message: str) -> None:
    """Write this rank's reason atomically (a reader never sees half a file); the first reason a rank writes stays."""
    path = Path(folder) / f"rank-{rank}.json"
    if path.exists():
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    failure = RankFailure(rank=rank, exit_code=exit_code, message=message, at=time.time())
    tmp.write_bytes(msgspec.json.encode(failure))
    os.replace(tmp, path)


def read_failures(folder: str | Path) -> list[RankFailure]:
    """Every reason written to `folder`, earliest first (unreadable files are skipped)."""
    found = []
    for path in Path(folder).glob("rank-*.json"):
        try:
            found.append(msgspec.json.decode(path.read_bytes(), type=RankFailure))
        except (OSError, msgspec.DecodeError):
            continue
    return sorted(found, key=lambda f: (f.at, f.rank))


def any_failure(folder: str | Path) -> bool:
    """Whether some rank wrote its reason to `folder` (cheap: one directory read)."""
    try:
        return any(e.name.startswith("rank-") for e in os.scandir(folder))
    except OSError:
        return False
