"""StoreExchange on 3 gloo ranks: every exchange gives every rank every rank's values (against the
values computed by hand), old values leave the store, exchanges never mix, a missing rank times out.
DeviceExchange (the GPU ranks' all-gather) on the same ranks with CPU tensors. HostExchange on 4
ranks as one host and as two and three hosts (given host ids): the same values, nothing left in
/dev/shm, a missing rank named at the timeout."""

from __future__ import annotations

import datetime
import random

import pytest
import torch.distributed as dist

from epdraft.parallel.exchange import shared_memory_ok
from tests.harness import run_ranks


def _exchanges(rank: int, world: int) -> dict:
    import torch

    from epdraft.parallel.exchange import DeviceExchange, StoreExchange

    group = dist.new_group([0, 2])  # a subset, its ranks not 0..n-1 in order of the world
    everyone = StoreExchange.over(dist.group.WORLD, width=3)
    other = StoreExchange.over(dist.group.WORLD, width=3)  # same ranks: must not read `everyone`'s keys
    out: dict = {"mismatches": []}
    for n in range(50):
        values = [(n, r, random.Random(n * 7 + r).randrange(-(2**62), 2**62)) for r in range(world)]
        got = everyone.all_gather(values[rank])
        if got != values:
            out["mismatches"].append((n, got))
        got = other.all_gather((-n, rank, 0))
        if got != [(-n, r, 0) for r in range(world)]:
            out["mismatches"].append(("other", n, got))
    # The GPU ranks' transport (an all-gather on the group), here on gloo and CPU tensors.
    device = DeviceExchange(dist.group.WORLD, device=torch.device("cpu"), width=2)
    out["device"] = [device.all_gather((n, rank * n)) for n in range(3)]
    # The draft's coordinator picks shared memory on CPU ranks (the store where it is not used), the
    # device group's all-gather on GPU ranks.
    import dataclasses
    from unittest import mock

    from epdraft.parallel.groups import Groups
    from epdraft.runtime.coordinator import StepCoordinator

    groups = Groups.from_process_groups(moe=dist.group.WORLD, attn_dp=dist.group.WORLD, cpu=dist.group.WORLD,
                                        ep_size=world, tp_size=1)  # fmt: skip
    cpu_sync = StepCoordinator.for_groups(groups, num_extras=1)
    out["cpu_sync"] = (type(cpu_sync._exchange).__name__, cpu_sync.sync(5, rank, (rank,)).counts)
    with mock.patch("epdraft.runtime.coordinator.shared_memory_ok", return_value=False):  # e.g. an aarch64 host
        store_sync = StepCoordinator.for_groups(groups, num_extras=1)
    out["store_sync"] = (type(store_sync._exchange).__name__, store_sync.sync(6, rank * 2, (rank,)).counts)
    with mock.patch("torch.cuda.current_device", return_value=0):
        gpu_sync = StepCoordinator.for_groups(dataclasses.replace(groups, device_type="cuda"), num_extras=1)
    out["gpu_sync"] = (type(gpu_sync._exchange).__name__, str(gpu_sync._exchange.device),
                       gpu_sync._exchange.group is groups.attn_dp)  # fmt: skip
    store = dist.distributed_c10d._get_default_store()
    out["kept"] = [n for n in range(50) if store.check([everyone._key(n, rank)])]
    if rank in (0, 2):
        pair = StoreExchange.over(group, width=1)
        out["pair"] = pair.all_gather((rank * 10,))
        short = store.clone()
        short.set_timeout(datetime.timedelta(seconds=1))
        lonely = StoreExchange(short, [0, 2], rank=rank, width=1)
        if rank == 0:  # rank 2 never joins this one
            try:
                lonely.all_gather((1,))
                out["timeout"] = None
            except RuntimeError as e:
                out["timeout"] = str(e)
    dist.barrier()
    return out


@pytest.mark.timeout(90)
def test_store_exchange_gathers_every_rank_in_order_and_cleans_up():
    results = run_ranks(3, _exchanges, timeout_s=80)
    for rank, out in enumerate(results):
        assert out["mismatches"] == [], (rank, out["mismatches"][:3])
        # Only the last exchange's value is left: the store does not grow with the steps.
        assert out["kept"] == [49], (rank, out["kept"])
    for out in results:
        assert out["cpu_sync"] == ("HostExchange" if shared_memory_ok() else "StoreExchange", (0, 1, 2))
        assert out["store_sync"] == ("StoreExchange", (0, 2, 4))
        assert out["gpu_sync"] == ("DeviceExchange", "cuda:0", True)
        assert out["device"] == [[(n, r * n) for r in range(3)] for n in range(3)], out["device"]
    assert results[0]["pair"] == results[2]["pair"] == [(0,), (20,)]
    assert "pair" not in results[1]
    assert results[0]["timeout"] is not None and "/2" in results[0]["timeout"], results[0]["timeout"]


def _host_exchanges(rank: int, world: int) -> dict:
    import os

    from epdraft.parallel.exchange import HostExchange

    store = dist.distributed_c10d._get_default_store()
    layouts = {"one host": None, "two hosts": ["h0", "h1", "h0", "h1"], "three hosts": ["a", "b", "a", "c"]}
    out: dict = {"mismatches": []}
    for name, hosts in layouts.items():
        host = None if hosts is None else hosts[rank]
        ex = HostExchange(store, range(world), rank=rank, width=3, host=host)
        other = HostExchange(store, range(world), rank=rank, width=1, host=host)  # same ranks, its own page
        out[name] = (ex.leaders, ex.local, ex.is_leader)
        for n in range(60):
            values = [(n, r, random.Random(n * 7 + r).randrange(-(2**62), 2**62)) for r in range(world)]
            got = ex.all_gather(values[rank])
            if got != values:
                out["mismatches"].append((name, n, got))
            if n % 3 == 0 and other.all_gather((rank - n,)) != [(r - n,) for r in range(world)]:
                out["mismatches"].append((name, "other", n))
    dist.barrier()  # every page mapped and its file unlinked by now
    out["left"] = [f for f in os.listdir("/dev/shm") if f.startswith("epdraft-exchange-")]
    if rank in (0, 2):  # a subset, one host; rank 2 never joins exchange 0
        short = store.clone()
        short.set_timeout(datetime.timedelta(seconds=1))
        pair = HostExchange(short, [2, 0], rank=rank, width=1)
        if rank == 0:
            try:
                pair.all_gather((1,))
                out["timeout"] = None
            except Exception as e:  # noqa: BLE001 - the test reads the message
                out["timeout"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    return out


@pytest.mark.timeout(90)
@pytest.mark.skipif(not shared_memory_ok(), reason="HostExchange needs Linux x86-64 with /dev/shm")
def test_host_exchange_gathers_every_rank_in_order_on_one_or_several_hosts():
    results = run_ranks(4, _host_exchanges, timeout_s=80)
    for rank, out in enumerate(results):
        assert out["mismatches"] == [], (rank, out["mismatches"][:3])
        assert out["left"] == [], out["left"]
        assert out["one host"] == ((0,), (0, 1, 2, 3), rank == 0)
        assert out["two hosts"] == ((0, 1), (0, 2) if rank % 2 == 0 else (1, 3), rank in (0, 1))
        assert out["three hosts"][0] == (0, 1, 3)  # the first rank of hosts a, b, c
    assert [out["three hosts"][1] for out in results] == [(0, 2), (1,), (0, 2), (3,)]
    assert results[0]["timeout"].startswith("ParallelError") and "ranks [2]" in results[0]["timeout"], results[0]


def _unshared_page(rank: int, world: int) -> dict:
    """Rank 1 claims rank 0's host but cannot open its page (as in a container with its own /dev/shm)."""
    import os
    from unittest import mock

    from epdraft.parallel.exchange import HostExchange

    short = dist.distributed_c10d._get_default_store().clone()
    short.set_timeout(datetime.timedelta(seconds=2))
    real_open = os.open

    def no_page(path, *args, **kwargs):
        if rank == 1 and str(path).startswith("/dev/shm/epdraft-exchange-"):
            raise FileNotFoundError(2, "No such file or directory", path)
        return real_open(path, *args, **kwargs)

    out: dict = {}
    with mock.patch("os.open", no_page):
        try:
            HostExchange(short, range(world), rank=rank, width=2, host="same")
            out["error"] = None
        except Exception as e:  # noqa: BLE001 - the test reads the message
            out["error"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    out["left"] = [f for f in os.listdir("/dev/shm") if f.startswith("epdraft-exchange-")]
    return out


@pytest.mark.timeout(60)
@pytest.mark.skipif(not shared_memory_ok(), reason="HostExchange needs Linux x86-64 with /dev/shm")
def test_a_rank_that_cannot_map_its_hosts_page_names_it_and_nothing_is_left():
    first, second = run_ranks(2, _unshared_page, timeout_s=50)
    assert second["error"].startswith("ParallelError: host exchange: rank 1 cannot open /dev/shm/epdraft-exchange-")
    assert "its host's first rank 0" in second["error"] and "must share /dev/shm" in second["error"], second
    # the first rank waited for rank 1 to map its page, up to the store's timeout, which names the key
    assert first["error"].startswith("DistStoreError") and "mapped/1" in first["error"], first
    assert first["left"] == second["left"] == []
