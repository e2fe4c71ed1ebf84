"""All-gather of a few int64 per rank: the step sync's two transports.

`StoreExchange` (CPU ranks) goes through the rendezvous store; `DeviceExchange` (GPU ranks) is one
NCCL all-gather on the device group, read back with one copy. The watchdog counts a main thread
inside this module as waiting on its peers, like one inside torch.distributed.

gloo's all-gather is a ring of 2(W-1) dependent rounds, each waking a gloo thread per rank:
measured on one 2-core host, 0.18 ms at W = 2 and 44 ms at W = 16. Through the store each rank
makes three requests per exchange (set its value, one multi-get of every rank's value, delete its
value of the exchange before), and the store's server answers the multi-gets as soon as the last
value lands: 0.06 ms at W = 2 and 1.1-1.4 ms at W = 16 on the same host (docs/performance.md,
`epdraft bench sync`). The price: the store host (torchrun's agent, or rank 0) serves 3W small
requests per step, and a peer that dies is noticed at the store's timeout (or by the watchdog,
at `cluster.hang_timeout_s`) rather than by a reset socket.
"""

from __future__ import annotations

import collections
import struct
from collections.abc import Sequence

import torch
import torch.distributed as dist

from epdraft.errors import ParallelError

# torch >= 2.13 renames all_gather_into_tensor (same semantics); older releases only have the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Exchanges over the same ranks are created in the same order on every rank (as groups are), so the
# k-th exchange over a rank set shares its keys with the k-th of every member, and no other's.
_CREATED: collections.Counter[tuple[int, ...]] = collections.Counter()


class StoreExchange:
    """Every member's `width` int64 values, through `store` (this rank's own clone of it).

    Args:
        store: the rendezvous store every rank of `ranks` reaches (the default group's).
        ranks: the global ranks that exchange, in the order results are returned.
        rank: this rank's global rank (one of `ranks`).
        width: how many int64 each rank contributes per exchange.
    """

    def __init__(self, store: dist.Store, ranks: Sequence[int], *, rank: int, width: int):
        self.ranks = tuple(ranks)
        if rank not in self.ranks:
            raise ParallelError(f"store exchange: rank {rank} is not among its ranks {list(self.ranks)}")
        self.rank = rank
        self._format = struct.Struct(f"<{width}q")
        self._store = store.clone()
        self._prefix = f"epdraft/exchange/{'-'.join(map(str, self.ranks))}.{_CREATED[self.ranks]}/"
        _CREATED[self.ranks] += 1
        self._count = 0

    @classmethod
    def over(cls, group: dist.ProcessGroup, *, width: int) -> StoreExchange:
        """An exchange among `group`'s ranks through the default process group's store."""
        store = dist.distributed_c10d._get_default_store()
        return cls(store, dist.get_process_group_ranks(group), rank=dist.get_rank(), width=width)

    def all_gather(self, values: Sequence[int]) -> list[tuple[int, ...]]:
        """Every rank's `values`, in `ranks` order; every rank must call it once per exchange.

        Blocks until every rank's value is in the store (up to the store's timeout, which raises
        torch's DistStoreError naming the keys still missing).
        """
        n = self._count
        self._count += 1
        self._store.set(self._key(n, self.rank), self._format.pack(*values))
        raw = self._store.multi_get([self._key(n, r) for r in self.ranks])
        if n >= 1:
            # Safe: this rank has every rank's value of exchange n, and a rank sets it only after
            # its multi-get of exchange n - 1 returned, so nobody reads n - 1 any more.
            self._store.delete_key(self._key(n - 1, self.rank))
        return [self._format.unpack(v) for v in raw]

    def _key(self, n: int, rank: int) -> str:
        return f"{self._prefix}{n}/{rank}"


class DeviceExchange:
    """Every member's `width` int64 values through one all-gather on `group` (NCCL: no TCP round,
    no gloo thread), on `device`; the host reads the result back (the one wait of the sync)."""

    def __init__(self, group: dist.ProcessGroup, *, device: torch.device, width: int):
        self.group = group
        self.device = device
        self.width = width
        self.size = dist.get_world_size(group)

    def all_gather(self, values: Sequence[int]) -> list[tuple[int, ...]]:
        """Every rank's `values`, in group order; every rank of `group` must call it."""
        mine_W = torch.tensor(values, dtype=torch.int64, device=self.device)
        gathered = torch.empty(self.size * self.width, dtype=torch.int64, device=self.device)
        _all_gather_single(gathered, mine_W, group=self.group)
        return [tuple(r) for r in gathered.view(self.size, self.width).tolist()]
