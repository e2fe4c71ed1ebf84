"""A rank stopped (SIGSTOP), killed (SIGKILL) or stuck in its main thread (its heartbeat beating on)
in the middle of `epdraft run`: every other rank exits soon after, the command ends with one line
naming the rank (no torchrun traceback), exit 1, and no process of the run is left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.faulty_run import REPO, processes_with, run_with_fault

SIGNAL_AT_STEP_ENV = "EPDRAFT_TEST_SIGNAL_AT"  # read by tests/e2e/faults/sitecustomize.py
STALL_AT_STEP_ENV = "EPDRAFT_TEST_STALL_AT"  # likewise
FAILURES_COPY_ENV = "EPDRAFT_TEST_FAILURES_COPY"  # likewise
HANG_S = 5


def _run_with_fault(fault: str) -> tuple[int, str, float]:
    """`epdraft run` with rank 1 sending itself the signal at step 3; (exit code, stderr, seconds
    from the signal to the command's exit). Asserts that nothing of the run outlives it."""
    args = ["--max-prompts", "4", "--max-new-tokens", "16", "--no-lossless-check", "--set",
            f"cluster.hang_timeout_s={HANG_S}"]  # fmt: skip
    run = run_with_fault({SIGNAL_AT_STEP_ENV: fault}, args, f"{SIGNAL_AT_STEP_ENV}: sending this rank")
    assert run.seen_at is not None, run.stderr
    assert processes_with(run.marker) == [], run.stderr
    return run.returncode, run.stderr, run.ended_at - run.seen_at


def _one_line(err: str, start: str) -> str:
    """The command's last line, which must start with `start` and be the only line naming the failure."""
    last = err.strip().splitlines()[-1]
    assert last.startswith(start), err
    assert err.count(last) == 1, err
    for noise in ("Traceback", "ChildFailedError", "Root Cause", "closing signal"):
        assert noise not in err, err
    return last


@pytest.mark.timeout(300)
def test_a_stopped_rank_is_named_within_hang_timeout_and_nothing_is_left():
    code, err, after_s = _run_with_fault("1:3:SIGSTOP")
    assert code == 1, err
    last = _one_line(err, "epdraft run: rank 1 stalled: no heartbeat for ")
    assert f"(cluster.hang_timeout_s = {HANG_S}; noticed by rank 0 at step 3, phase step sync)" in last, err
    assert "sent SIGUSR1 to its pid" in last, err
    # Its stacks print when the SIGCONT after the SIGUSR1 lets it run (where it is by then varies).
    assert "(most recent call first):" in err, "the stalled rank's stack dump passes the mute: " + err
    assert after_s <= HANG_S + 10, err


@pytest.mark.timeout(300)
def test_a_killed_rank_is_named_and_nothing_is_left():
    code, err, after_s = _run_with_fault("1:3:SIGKILL")
    assert code == 1, err
    last = _one_line(err, "epdraft run: rank 1 (node 0, pid ")
    assert ") died at " in last and " (its last heartbeat): Signal 9 (SIGKILL) received by PID " in last, err
    assert after_s <= 10, err


@pytest.mark.timeout(300)
def test_a_rank_stuck_inside_an_all_to_all_is_named_by_every_peer(tmp_path: Path):
    """4 gloo ranks, experts over all 4 (all-to-all); rank 1's main thread sleeps inside its first
    all-to-all of step 3 while its heartbeat thread beats on. Before, its peers waited until
    cluster.timeout_s and said "every peer still beats"."""
    args = [str(REPO / "configs" / "local-cpu-4.toml"), "--max-prompts", "4", "--max-new-tokens", "16",
            "--no-lossless-check", "--set", "draft.moe_layout=alltoall", "--set", "draft.moe_ep=4", "--set",
            "draft.moe_tp=1", "--set", f"cluster.hang_timeout_s={HANG_S}"]  # fmt: skip
    fault = {STALL_AT_STEP_ENV: "1:3:120", FAILURES_COPY_ENV: str(tmp_path)}
    run = run_with_fault(fault, args, f"{STALL_AT_STEP_ENV}: this rank")
    assert run.seen_at is not None, run.stderr
    assert processes_with(run.marker) == [], run.stderr
    assert run.returncode == 1, run.stderr
    last = _one_line(run.stderr, "epdraft run: rank 1 stuck: its heartbeat beats but its main thread has not moved ")
    assert "(last at step 3, phase draft layer 0 MoE, not in a collective)" in last, run.stderr
    assert "sent SIGUSR1 to its pid" in last, run.stderr
    assert run.ended_at - run.seen_at <= HANG_S + 10, run.stderr
    for rank in (0, 2, 3):  # every survivor names rank 1, and only it
        reason = (tmp_path / f"rank-{rank}.txt").read_text()
        assert reason.startswith("rank 1 stuck: "), (rank, reason)
        named = {f"rank {r} " for r in range(4) if f"rank {r} stuck" in reason or f"lost rank {r}" in reason}
        assert named == {"rank 1 "}, (rank, reason)
