"""Test-only fault injection, loaded by every Python process started with this folder on PYTHONPATH.

Only torchrun's workers (they carry RANK) install anything, and only when a variable asks:

- EPDRAFT_TEST_KILL_DRAFT_AT="RANK:STEP": global rank RANK SIGKILLs itself as its disaggregated
  draft loop enters step STEP, the way a crashed node disappears (a hook at epdraft's seam
  `epdraft.worker.disagg.DRAFT_STEP_HOOKS`).
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

if _kill_spec and "RANK" in os.environ:
    from epdraft.worker import disagg

    _who, _, _at = _kill_spec.partition(":")

    def _kill_at(rank: int, step: int) -> None:
        if rank == int(_who) and step == int(_at):
            _log.warning("%s: killing this rank at step %d", KILL_AT_STEP_ENV, step)
            os.kill(os.getpid(), signal.SIGKILL)

    disagg.DRAFT_STEP_HOOKS.append(_kill_at)

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
