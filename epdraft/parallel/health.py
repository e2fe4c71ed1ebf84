"""Health check: one all-reduce on every group, checked against the sum its members must give.

Run once at start, so a miswired layout (wrong members, a dead link, a rank in the wrong group)
stops the run with the group's name instead of producing wrong tokens or hanging at step 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from epdraft.errors import ParallelError
from epdraft.parallel.groups import GROUP_NAMES, Groups


def check_all_reduce(group: dist.ProcessGroup, name: str) -> None:
    """All-reduce (global rank + 1) over `group` and compare with the sum over its member ranks.

    Every member of `group` must call this. Raises ParallelError naming the group on a mismatch.
    """
    ranks = dist.get_process_group_ranks(group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    x = torch.tensor([dist.get_rank() + 1], dtype=torch.int64, device=device)
    dist.all_reduce(x, group=group)
    got, expected = int(x.item()), sum(r + 1 for r in ranks)
    if got != expected:
        raise ParallelError(
            f"health check: all-reduce over group {name!r} (ranks {ranks}) gave {got} on rank {dist.get_rank()}, "
            f"expected {expected}"
        )


def health_check(groups: Groups) -> None:
    """Check every distinct draft group once, in a fixed order (the same on every rank, so no rank
    waits on another); a group serving several names (`Groups` makes one per membership) is
    named by all of them."""
    names: dict[int, list[str]] = {}
    distinct = []
    for name in GROUP_NAMES:
        group = getattr(groups, name)
        if group is None:
            continue
        if id(group) not in names:
            names[id(group)] = []
            distinct.append(group)
        names[id(group)].append(name)
    for group in distinct:
        check_all_reduce(group, "/".join(names[id(group)]))
