"""Test-only fault injection, loaded by every Python process started with this folder on PYTHONPATH.

Only torchrun's workers (they carry RANK) install anything, and only when a variable asks:

- EPDRAFT_TEST_KILL_DRAFT_AT="RANK:STEP": global rank RANK SIGKILLs itself as its disaggregated
  draft loop enters step STEP, the way a crashed node disappears: `PeerLink.recv_target_step`,
  the loop's first call of a step (before any of the step's messages is read), wrapped here.
- EPDRAFT_TEST_SIGNAL_AT="RANK:STEP:SIGNAL" (e.g. "1:3:SIGSTOP"): global rank RANK sends itself
  SIGNAL as `DraftRuntime.propose` enters step STEP (colocated runs), wrapped here.

epdraft itself reads no such variable.
"""

import os

KILL_AT_STEP_ENV = "EPDRAFT_TEST_KILL_DRAFT_AT"
SIGNAL_AT_STEP_ENV = "EPDRAFT_TEST_SIGNAL_AT"
_kill_spec = os.environ.get(KILL_AT_STEP_ENV, "")
_signal_spec = os.environ.get(SIGNAL_AT_STEP_ENV, "")

if (_kill_spec or _signal_spec) and "RANK" in os.environ:  # only torchrun's workers carry RANK
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
