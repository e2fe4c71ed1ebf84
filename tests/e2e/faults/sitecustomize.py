"""Test-only fault injection, loaded by every Python process started with this folder on PYTHONPATH.

Only torchrun's workers (they carry RANK) install anything, and only when a variable asks:

- EPDRAFT_TEST_KILL_DRAFT_AT="RANK:STEP": global rank RANK SIGKILLs itself as its disaggregated
  draft loop enters step STEP, the way a crashed node disappears: `PeerLink.recv_target_step`,
  the loop's first call of a step (before any of the step's messages is read), wrapped here.
- EPDRAFT_TEST_SIGNAL_AT="RANK:STEP:SIGNAL" (e.g. "1:3:SIGSTOP"): global rank RANK sends itself
  SIGNAL as `DraftRuntime.propose` enters step STEP (colocated runs), wrapped here.
- EPDRAFT_TEST_STALL_AT="RANK:STEP:SECONDS": global rank RANK's main thread sleeps SECONDS inside
  its first all-to-all of step STEP (`torch.distributed.all_to_all_single`, wrapped here), its
  heartbeat thread beating on: a deadlock or a hung kernel, as its peers see it.
- EPDRAFT_TEST_FAILURES_COPY="DIR": every rank also writes the reason it fails with (what it
  writes for the launcher, which prints only the first) to DIR/rank-R.txt.

epdraft itself reads no such variable.
"""

import os

KILL_AT_STEP_ENV = "EPDRAFT_TEST_KILL_DRAFT_AT"
SIGNAL_AT_STEP_ENV = "EPDRAFT_TEST_SIGNAL_AT"
STALL_AT_STEP_ENV = "EPDRAFT_TEST_STALL_AT"
FAILURES_COPY_ENV = "EPDRAFT_TEST_FAILURES_COPY"
_kill_spec = os.environ.get(KILL_AT_STEP_ENV, "")
_signal_spec = os.environ.get(SIGNAL_AT_STEP_ENV, "")
_stall_spec = os.environ.get(STALL_AT_STEP_ENV, "")
_failures_copy = os.environ.get(FAILURES_COPY_ENV, "")

if (_kill_spec or _signal_spec or _stall_spec) and "RANK" in os.environ:  # only torchrun's workers carry RANK
    import logging
    import signal

    _log = logging.getLogger("epdraft.tests.faults")

if _kill_spec and "RANK" in os.environ and os.environ["RANK"] == _kill_spec.split(":")[0]:
    from epdraft.worker import pairing as _pairing

    _kill_step = int(_kill_spec.split(":")[1])
    _recv_target_step = _pairing.PeerLink.recv_target_step

    def _kill_then_recv(self, target, step, *args, **kwargs):
        if step == _kill_step:
            _log.warning("%s: killing this rank at step %d", KILL_AT_STEP_ENV, step)
            os.kill(os.getpid(), signal.SIGKILL)
        return _recv_target_step(self, target, step, *args, **kwargs)

    _pairing.PeerLink.recv_target_step = _kill_then_recv

if _signal_spec and "RANK" in os.environ and os.environ["RANK"] == _signal_spec.split(":")[0]:
    from epdraft.runtime import draft as _draft

    _at_step, _signum = int(_signal_spec.split(":")[1]), signal.Signals[_signal_spec.split(":")[2]]
    _propose = _draft.DraftRuntime.propose

    def _propose_then_signal(self, step, *args, **kwargs):
        if step == _at_step:
            _log.warning("%s: sending this rank (pid %d) %s at step %d", SIGNAL_AT_STEP_ENV, os.getpid(),
                         _signum.name, step)
            os.kill(os.getpid(), _signum)
        return _propose(self, step, *args, **kwargs)

    _draft.DraftRuntime.propose = _propose_then_signal

if _stall_spec and "RANK" in os.environ and os.environ["RANK"] == _stall_spec.split(":")[0]:
    import time

    import torch.distributed as _dist

    from epdraft.runtime import draft as _draft

    _stall_step, _stall_s = int(_stall_spec.split(":")[1]), float(_stall_spec.split(":")[2])
    _stall = {"step": None, "done": False}
    _propose_then_stall = _draft.DraftRuntime.propose
    _all_to_all_single = _dist.all_to_all_single

    def _propose_noting_step(self, step, *args, **kwargs):
        _stall["step"] = step
        return _propose_then_stall(self, step, *args, **kwargs)

    def _stalling_all_to_all_single(*args, **kwargs):
        if _stall["step"] == _stall_step and not _stall["done"]:
            _stall["done"] = True
            _log.warning("%s: this rank (pid %d) sleeps %g s inside an all-to-all at step %d", STALL_AT_STEP_ENV,
                         os.getpid(), _stall_s, _stall_step)
            time.sleep(_stall_s)
        return _all_to_all_single(*args, **kwargs)

    _draft.DraftRuntime.propose = _propose_noting_step
    _dist.all_to_all_single = _stalling_all_to_all_single

if _failures_copy and "RANK" in os.environ:
    from pathlib import Path

    from epdraft.parallel import failure as _failure

    _write_failure = _failure.write_failure

    def _write_failure_and_copy(folder, rank, exit_code, message):
        Path(_failures_copy, f"rank-{rank}.txt").write_text(message)
        return _write_failure(folder, rank, exit_code, message)

    _failure.write_failure = _write_failure_and_copy
