"""Joining and leaving the torch.distributed world, so that leaving it frees every group.

A group's gloo threads must be joined while the interpreter is whole: one still running into
interpreter shutdown once aborted a rank that had finished its work ("terminate called without
an active exception", seen in CI). Two things kept groups alive past `destroy_process_group`:

- `torch.distributed.nn.functional` binds `group=group.WORLD` as default arguments when it is first
  imported. Imported after `init_process_group` (transformers' `from_pretrained` imports it, through
  FSDP), those defaults hold the world group for the rest of the process. `join_world` imports it
  first, so they bind to None.
- Groups held by garbage in reference cycles (a draft rank's run objects: 15 gloo threads survived
  `destroy_process_group` there) are freed only by the cycle collector: `leave_world` runs it.
"""

from __future__ import annotations

import datetime
import gc

import torch.distributed as dist


def join_world(backend: str, *, timeout: datetime.timedelta, **kwargs) -> None:
    """`dist.init_process_group(backend, timeout=timeout, **kwargs)`, after the import above."""
    import torch.distributed.nn  # noqa: F401 - binds its `group=WORLD` defaults before there is a world

    dist.init_process_group(backend, timeout=timeout, **kwargs)


def leave_world() -> None:
    """Destroy every group and free them now (their threads are joined here, not at exit)."""
    dist.destroy_process_group()
    gc.collect()
