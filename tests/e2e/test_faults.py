"""A rank stopped (SIGSTOP) or killed (SIGKILL) in the middle of `epdraft run`: every other rank
exits soon after, the command ends with one line naming the rank (no torchrun traceback), exit 1,
and no process of the run is left behind."""

from __future__ import annotations

import pytest

from tests.e2e.faulty_run import processes_with, run_with_fault

SIGNAL_AT_STEP_ENV = "EPDRAFT_TEST_SIGNAL_AT"  # read by tests/e2e/faults/sitecustomize.py
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
