"""Point-to-point operations between paired ranks: a post, and a wait that names what failed.

The waits live here, in `parallel`, because the watchdog tells a rank waiting on its peers (in
torch.distributed, the step sync's exchange, or these waits) from a stuck one by the file of its
main thread's innermost Python frame: a rank blocked on its pair (a target still loading before
its Hello, a credit not yet sent) is waiting, not stuck.
"""

from __future__ import annotations

from typing import Callable

import torch.distributed as dist

from epdraft.errors import ParallelError


def start(post: Callable[[], dist.Work], what: str) -> dist.Work:
    """Post a point-to-point op; a peer already gone (gloo refuses the post itself, not only the
    wait, when the peer closed first) becomes a ParallelError naming `what`."""
    try:
        return post()
    except RuntimeError as e:
        raise ParallelError(f"{what} failed: {e}") from e


def wait(work: dist.Work, what: str) -> None:
    """Wait on `work`; a peer that died or timed out becomes a ParallelError naming `what`."""
    try:
        work.wait()
    except RuntimeError as e:
        raise ParallelError(f"{what} failed: {e}") from e
