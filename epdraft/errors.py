"""Every error epdraft raises on purpose.

Each message names what is at fault (file, key path, tensor, rank) and what was expected, so a bad
input stops the run with one readable line instead of a hang or a stack trace deep in a collective.
"""

import signal


class EpdraftError(Exception):
    """Base class of every error epdraft raises on purpose."""


class ConfigError(EpdraftError, ValueError):
    """A config (HF config.json, ParallelConfig file, CLI override) the runtime cannot run."""


class LoadError(EpdraftError):
    """A checkpoint that is missing tensors, has wrong shapes or cannot be read."""


class ParallelError(EpdraftError):
    """A process-group, backend or hardware problem found while building or running a layout.

    Raised by a running rank it is a fault, not bad input: the rank exits 1.
    """


class StepMismatch(ParallelError):
    """Ranks disagree on the step id: they are no longer in lockstep."""


class NonFiniteError(EpdraftError):
    """A draft's hidden states went NaN or inf during a run (names the rank, step and layer)."""


class RequestError(EpdraftError):
    """One request is malformed (empty prompt, token id outside the vocabulary)."""


class Interrupted(EpdraftError):
    """The user stopped a command that had started ranks (Ctrl-C, SIGTERM, SIGHUP); every rank was stopped.

    The command exits 128 + `signum`, as a shell reports a process killed by that signal.
    """

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}: every rank stopped")


class RankFailed(EpdraftError):
    """A rank of a launched command failed; the message is its one-line reason, as the rank wrote it.

    `exit_code`: 2 when the rank refused its input, 1 for a fault (a lost or stalled peer, a bug).
    """

    def __init__(self, message: str, exit_code: int):
        self.exit_code = exit_code
        super().__init__(message)
