"""All-gather of a few int64 per rank: the step sync's transports.

`HostExchange` (CPU ranks) goes through shared memory among the ranks of one host and through the
rendezvous store among hosts; `StoreExchange` goes through the store alone (hosts where shared
memory is not used, and `HostExchange`'s hops between hosts); `DeviceExchange` (GPU ranks) is one
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

The store is one server thread: on a 16-core host a bare get by each of 16 ranks already takes
3.1x one exchange of 2 ranks (docs/performance.md), so no exchange through one store scales. On
one host a rank's value needs no server: `HostExchange` has each rank write its value into a
shared page and read its peers' there (7-13 µs at W = 2-16 on a 16-core host, `bench sync`);
ranks of other hosts are reached through one `StoreExchange` among each host's first rank.
"""

from __future__ import annotations

import collections
import mmap
import os
import platform
import secrets
import socket
import struct
import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from epdraft.errors import ParallelError

# torch >= 2.13 renames all_gather_into_tensor (same semantics); older releases only have the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Polls of a peer's value before the waiting rank yields its core, and the wait after which it
# sleeps between polls (a peer far behind, e.g. in a long prefill, should get the core back).
_SPIN_POLLS = 64
_SLEEP_AFTER_S = 1e-3
_SLEEP_S = 5e-5
_LINE_WORDS = 8  # int64 words in a 64-byte cache line
# Exchanges over the same ranks are created in the same order on every rank (as groups are), so the
# k-th exchange over a rank set shares its keys with the k-th of every member, and no other's.
_CREATED: collections.Counter[tuple] = collections.Counter()


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


def host_id() -> str:
    """This machine's name and boot, and which /dev/shm it sees: ranks with the same id share it
    (containers of one machine with their own /dev/shm mount, e.g. docker without --ipc=host, differ
    in the mount's device)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        shm = os.stat("/dev/shm")
    except OSError:
        return socket.gethostname()
    return f"{socket.gethostname()}/{boot}/{shm.st_dev}:{shm.st_ino}"


def shared_memory_ok() -> bool:
    """Whether `HostExchange` can run here: Linux with /dev/shm, on x86-64, whose stores reach other
    cores in program order (a value written before its exchange number is seen before it; Python
    has no fence to ask for that on weaker memory models, e.g. aarch64)."""
    return (platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
            and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK))  # fmt: skip


class HostExchange:
    """Every member's `width` int64 values: through one shared page among the members on each host,
    and one `StoreExchange` among the hosts' first members (their leaders) when there are several.

    Each exchange n uses buffer n % 2: a member writes its values then n + 1 into its slot and
    reads its host's slots once all show n + 1; a leader of several hosts then exchanges its
    host's values with the other leaders and writes the whole result (then n + 1) for its members.
    Two buffers are enough: a member writes buffer n % 2 again at n + 2 only after every member
    of its host has finished n + 1, i.e. has read n.

    Args:
        store: the rendezvous store every member reaches (the default group's).
        ranks: the global ranks that exchange, in the order results are returned.
        rank: this rank's global rank (one of `ranks`).
        width: how many int64 each rank contributes per exchange.
        host: which host this rank is on (default `host_id()`; members with the same one must
            share /dev/shm).
    Raises ParallelError when `rank` is not a member, or a member of this host cannot map its
    leader's page; the store's timeout when a member never constructs its exchange.
    """

    def __init__(self, store: dist.Store, ranks: Sequence[int], *, rank: int, width: int, host: str | None = None):
        self.ranks = tuple(ranks)
        if rank not in self.ranks:
            raise ParallelError(f"host exchange: rank {rank} is not among its ranks {list(self.ranks)}")
        self.rank = rank
        self.width = width
        self._timeout_s = store.timeout.total_seconds()
        prefix = f"epdraft/host-exchange/{'-'.join(map(str, self.ranks))}.{_CREATED['host', *self.ranks]}/"
        _CREATED["host", *self.ranks] += 1
        host = host_id() if host is None else host
        store.set(f"{prefix}host/{rank}", host)
        hosts = [h.decode() for h in store.multi_get([f"{prefix}host/{r}" for r in self.ranks])]
        self.local = tuple(r for r, h in zip(self.ranks, hosts) if h == host)  # this host's members
        members: dict[str, list[int]] = {}  # each host's members in `ranks` order, hosts in order of first rank
        for r, h in zip(self.ranks, hosts):
            members.setdefault(h, []).append(r)
        self.leaders = tuple(m[0] for m in members.values())
        order = list(members)
        # where each member's values are, in `ranks` order: (its host, its slot there)
        self._place = [(order.index(h), members[h].index(r)) for r, h in zip(self.ranks, hosts)]
        self._max_local = max(len(m) for m in members.values())
        self._mine = self.local.index(rank)
        self.is_leader = self._mine == 0
        L, W = len(self.local), len(self.ranks)
        line = -(-(1 + width) // _LINE_WORDS) * _LINE_WORDS  # a slot per cache line: writers never share one
        per_buffer = L * line + -(-(1 + W * width) // _LINE_WORDS) * _LINE_WORDS  # slots, then the result
        self._map = self._attach(store, prefix, 8 * _LINE_WORDS + 8 * 2 * per_buffer)  # first line: the token
        words = np.frombuffer(self._map, dtype=np.int64)
        buffers = [words[_LINE_WORDS + b * per_buffer :][:per_buffer] for b in (0, 1)]
        self._slots = [buf[: L * line].reshape(L, line)[:, : 1 + width] for buf in buffers]
        self._results = [buf[L * line :][: 1 + W * width] for buf in buffers]
        self._across = (
            StoreExchange(store, self.leaders, rank=rank, width=self._max_local * width)
            if self.is_leader and len(self.leaders) > 1
            else None
        )
        self._count = 0

    @classmethod
    def over(cls, group: dist.ProcessGroup, *, width: int) -> HostExchange:
        """An exchange among `group`'s ranks, its hosts' leaders meeting in the default group's store."""
        store = dist.distributed_c10d._get_default_store()
        return cls(store, dist.get_process_group_ranks(group), rank=dist.get_rank(), width=width)

    def _attach(self, store: dist.Store, prefix: str, nbytes: int) -> mmap.mmap:
        """The host's page, mapped: its leader creates it under /dev/shm, its members map it and
        check the leader's token in its first word, and the leader unlinks the file once every
        member has it mapped (nothing is left in /dev/shm, whatever happens to the ranks later)."""
        leader = self.local[0]
        if self.rank == leader:
            token = secrets.randbits(63)
            path = f"/dev/shm/epdraft-exchange-{os.getpid()}-{token:x}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, nbytes)
                page = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
            np.frombuffer(page, dtype=np.int64)[0] = token
            store.set(f"{prefix}page/{leader}", f"{path} {token}")
            try:
                store.multi_get([f"{prefix}mapped/{r}" for r in self.local[1:]]) if len(self.local) > 1 else None
            finally:
                os.unlink(path)
            return page
        path, token = store.get(f"{prefix}page/{leader}").decode().split()
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise ParallelError(
                f"host exchange: rank {self.rank} cannot open {path}, the page of its host's first rank {leader} "
                f"({e.strerror}): ranks with the same host id ({host_id()!r}) must share /dev/shm"
            ) from None
        try:
            page = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        if int(np.frombuffer(page, dtype=np.int64)[0]) != int(token):
            raise ParallelError(f"host exchange: rank {self.rank} mapped {path}, which is not rank {leader}'s page")
        store.set(f"{prefix}mapped/{self.rank}", b"1")
        return page

    def all_gather(self, values: Sequence[int]) -> list[tuple[int, ...]]:
        """Every rank's `values`, in `ranks` order; every rank must call it once per exchange.

        Raises ParallelError naming the members not arrived after the store's timeout."""
        n = self._count
        self._count += 1
        slots, result = self._slots[n % 2], self._results[n % 2]
        slots[self._mine, 1:] = values
        slots[self._mine, 0] = n + 1  # after the values: a reader that sees n + 1 sees them
        if len(self.leaders) == 1:
            self._wait(lambda: bool((slots[:, 0] == n + 1).all()), n, lambda: self._late(slots, n))
            got = slots[:, 1:].tolist()
            return [tuple(got[s]) for _, s in self._place]
        if self.is_leader:
            self._wait(lambda: bool((slots[:, 0] == n + 1).all()), n, lambda: self._late(slots, n))
            mine = np.zeros((self._max_local, self.width), dtype=np.int64)
            mine[: len(self.local)] = slots[:, 1:]
            hosts = self._across.all_gather(mine.ravel().tolist())
            flat = [hosts[h][s * self.width : (s + 1) * self.width] for h, s in self._place]
            result[1:] = np.asarray(flat, dtype=np.int64).ravel()
            result[0] = n + 1
            return [tuple(v) for v in flat]
        self._wait(lambda: int(result[0]) == n + 1, n, lambda: [self.local[0]])
        got = result[1:].reshape(len(self.ranks), self.width).tolist()
        return [tuple(v) for v in got]

    def _late(self, slots: np.ndarray, n: int) -> list[int]:
        return [r for r, seen in zip(self.local, slots[:, 0].tolist()) if seen != n + 1]

    def _wait(self, arrived, n: int, late) -> None:
        """Poll `arrived()`, yielding the core between polls after a few, then sleeping between them."""
        polls = 0
        start = None
        while not arrived():
            polls += 1
            if polls < _SPIN_POLLS:
                continue
            now = time.perf_counter()
            if start is None:
                start = now
            elif now - start > self._timeout_s:
                raise ParallelError(
                    f"host exchange {n} on rank {self.rank}: ranks {late()} of this host did not arrive "
                    f"within {self._timeout_s:.0f} s (the store's timeout)"
                )
            if now - start > _SLEEP_AFTER_S:
                time.sleep(_SLEEP_S)
            else:
                os.sched_yield()
