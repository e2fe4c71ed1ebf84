"""Worker logging: every line prefixed `[rank r/W]`; run facts logged once through `info_rank0`.

Neither function synchronizes: the rank is read from the local process-group state, never agreed on.
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

_FORMAT = "[rank %(rank)s/%(world)s] %(asctime)s %(levelname)s %(name)s: %(message)s"


class _RankFilter(logging.Filter):
    """Stamps the rank at emit time: the process group's, else the RANK / WORLD_SIZE torchrun set
    (an error logged before init or after teardown still names its rank), else `?`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if dist.is_available() and dist.is_initialized():
            record.rank, record.world = dist.get_rank(), dist.get_world_size()
        else:
            record.rank, record.world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
        return True


def setup_logging(level: str = "INFO") -> None:
    """Route the root logger to stderr with the `[rank r/W]` prefix (called once, by the worker entry point)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RankFilter())
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def info_rank0(
    log: logging.Logger, group: dist.ProcessGroup | None, msg: str, *args: object, level: int = logging.INFO
) -> None:
    """Log `msg` at INFO (or `level`: DEBUG for details a default run does not print) on rank 0 of
    `group` (the world when None) only; a no-op on every other rank."""
    if not dist.is_initialized() or dist.get_rank(group) == 0:
        log.log(level, msg, *args, stacklevel=2)
