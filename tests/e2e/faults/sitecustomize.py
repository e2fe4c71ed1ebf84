"""Test-only fault injection, loaded by every Python process started with this folder on PYTHONPATH.

EPDRAFT_TEST_KILL_DRAFT_AT="RANK:STEP" makes global rank RANK SIGKILL itself as its draft loop
enters step STEP, the way a crashed node disappears. It installs a hook at epdraft's seam
(`epdraft.worker.disagg.DRAFT_STEP_HOOKS`); epdraft itself reads no such variable.
"""

import os

KILL_AT_STEP_ENV = "EPDRAFT_TEST_KILL_DRAFT_AT"
_spec = os.environ.get(KILL_AT_STEP_ENV, "")

if _spec and "RANK" in os.environ:  # only torchrun's workers carry RANK
    import logging
    import signal

    from epdraft.worker import disagg

    _who, _, _at = _spec.partition(":")

    def _kill_at(rank: int, step: int) -> None:
        if rank == int(_who) and step == int(_at):
            logging.getLogger("epdraft.tests.faults").warning("%s: killing this rank at step %d", KILL_AT_STEP_ENV, step)
            os.kill(os.getpid(), signal.SIGKILL)

    disagg.DRAFT_STEP_HOOKS.append(_kill_at)
