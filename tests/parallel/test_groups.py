"""Groups on gloo: members and all-reduce sums of every group, against ranks computed by hand."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from epdraft.config.parallel import parallel_config_from_dict
from epdraft.dispatch import MoeLayout
from epdraft.models import read_draft_spec
from epdraft.errors import ParallelError
from epdraft.parallel.groups import GROUP_NAMES, Groups, layout_table, resolve_backend
from epdraft.parallel.health import check_all_reduce, health_check
from tests.harness import run_ranks

TINY_DRAFT = Path(__file__).resolve().parents[2] / "epdraft" / "assets" / "tiny-draft"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _config(world: int, ep: int, tp: int, layout: str, nnodes: int = 1, draft_nodes: tuple[int, ...] = ()):
    disaggregated = bool(draft_nodes)
    nproc = world // nnodes
    draft_world = len(draft_nodes) * nproc if disaggregated else world
    return parallel_config_from_dict(
        {
            "cluster": {"nnodes": nnodes, "nproc_per_node": nproc, "device": "cpu", "backend": "gloo", "timeout_s": 30},
            "draft": {"attn_dp": draft_world, "moe_layout": layout, "moe_ep": ep, "moe_tp": tp},
            "target": {"dp": world - draft_world if disaggregated else world},
            "placement": {"mode": "disaggregated", "draft_nodes": list(draft_nodes)} if disaggregated else {},
        }
    )


def _expected(draft_ranks: list[int], i: int, ep: int, tp: int) -> dict[str, list[int]]:
    """Members of each group of the draft rank at index i, from the row-major (moe_dp, moe_ep, moe_tp) rule."""
    dp_idx, ep_rank, tp_rank = i // (ep * tp), (i // tp) % ep, i % tp
    base = dp_idx * ep * tp
    at = lambda idx: [draft_ranks[j] for j in idx]  # noqa: E731
    return {
        "moe": at(range(base, base + ep * tp)),
        "moe_ep": at(base + e * tp + tp_rank for e in range(ep)),
        "moe_tp": at(base + ep_rank * tp + t for t in range(tp)),
        "attn_dp": list(draft_ranks),
        "cpu": list(draft_ranks),
    }


def check_layouts(rank: int, world: int, layouts: list[tuple]) -> int:
    for layout in layouts:
        pc = _config(world, *layout)
        groups = Groups.from_config(pc)
        draft_ranks = list(pc.draft_ranks)
        if rank not in draft_ranks:
            assert groups is None, (layout, rank)
            continue
        i = draft_ranks.index(rank)
        ep, tp = pc.draft.moe_ep, pc.draft.moe_tp
        expected = _expected(draft_ranks, i, ep, tp)
        for name, members in expected.items():
            group = groups.get(name)
            assert dist.get_process_group_ranks(group) == members, (layout, rank, name)
            # 2**rank summed over the group is the bitmask of its members: a wrong member shows.
            x = torch.tensor([2**rank], dtype=torch.int64)
            dist.all_reduce(x, group=group)
            assert x.item() == sum(2**m for m in members), (layout, rank, name)
        assert (groups.ep_rank, groups.tp_rank) == ((i // tp) % ep, i % tp), (layout, rank)
        assert (groups.ep_size, groups.tp_size, groups.dp_rank, groups.dp_size) == (ep, tp, i, len(draft_ranks))
        assert dist.get_rank(groups.moe) == groups.ep_rank * tp + groups.tp_rank
        assert groups.mesh is not None and groups.mesh.mesh_dim_names == ("moe_dp", "moe_ep", "moe_tp")
        # The MoeLayout every consumer reads takes this rank's coordinates from the groups, once.
        moe = MoeLayout.resolve(pc, read_draft_spec(TINY_DRAFT).ffn, groups)
        coords = (groups.ep_rank, ep, groups.tp_rank, tp) if moe.layout != "replicated" else (0, 1, 0, 1)
        assert (moe.ep_rank, moe.ep_size, moe.tp_rank, moe.tp_size) == coords, (layout, rank)
        health_check(groups)
    return rank


@pytest.mark.timeout(120)
def test_groups_world_2():
    layouts = [(1, 1, "replicated"), (2, 1, "alltoall"), (1, 2, "gather"), (1, 1, "alltoall")]
    assert run_ranks(2, check_layouts, layouts, timeout_s=100) == [0, 1]


@pytest.mark.timeout(150)
def test_groups_world_4_colocated_and_disaggregated():
    layouts = [
        (2, 2, "gather"),
        (4, 1, "alltoall"),
        (2, 1, "alltoall"),  # two copies of the experts
        (1, 2, "gather"),
        (1, 4, "auto"),
        (2, 1, "alltoall", 2, (1,)),  # draft on node 1 = ranks 2, 3
        (1, 2, "gather", 2, (0,)),  # draft on node 0 = ranks 0, 1
    ]
    assert run_ranks(4, check_layouts, layouts, timeout_s=130) == [0, 1, 2, 3]


def check_errors_and_engine_groups(rank: int, world: int) -> None:
    with pytest.raises(ParallelError, match=r"has 4 ranks but cluster.nnodes x cluster.nproc_per_node = 1 x 2 = 2"):
        Groups.from_config(_config(2, 1, 1, "replicated"))

    # An engine's own groups (ep 2 x tp 2), created in the same order on every rank.
    moe = dist.new_group([0, 1, 2, 3])
    ep_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cpu = dist.new_group([0, 1, 2, 3], backend="gloo")
    world_group = dist.group.WORLD
    groups = Groups.from_process_groups(
        moe=moe, attn_dp=world_group, cpu=cpu, ep_size=2, tp_size=2, moe_ep=ep_groups[rank % 2],
        moe_tp=tp_groups[rank // 2],
    )  # fmt: skip
    assert groups.mesh is None
    assert (groups.ep_rank, groups.tp_rank, groups.dp_rank, groups.dp_size) == (rank // 2, rank % 2, rank, 4)
    health_check(groups)
    with pytest.raises(ParallelError, match="pass moe_ep"):
        Groups.from_process_groups(moe=moe, attn_dp=world_group, cpu=cpu, ep_size=2, tp_size=2)
    with pytest.raises(ParallelError, match=r"moe group has 4 ranks but ep_size x tp_size = 2 x 1"):
        Groups.from_process_groups(moe=moe, attn_dp=world_group, cpu=cpu, ep_size=2, tp_size=1)
    ep_only = Groups.from_process_groups(moe=moe, attn_dp=world_group, cpu=cpu, ep_size=4, tp_size=1)
    assert ep_only.moe_ep is moe and ep_only.moe_tp is None and (ep_only.ep_rank, ep_only.tp_rank) == (rank, 0)
    health_check(ep_only)
    with pytest.raises(ParallelError, match="group 'moe_tp' was not passed by the engine"):
        ep_only.get("moe_tp")
    with pytest.raises(ParallelError, match="no group named 'ep'; valid: " + ", ".join(GROUP_NAMES)):
        groups.get("ep")

    # A wrong sum names the group (all_reduce made a no-op so only this rank's value comes back).
    with mock.patch.object(dist, "all_reduce", lambda *a, **k: None):
        with pytest.raises(ParallelError, match=r"group 'moe' \(ranks \[0, 1, 2, 3\]\) gave \d+ on rank \d, expected 10"):
            check_all_reduce(moe, "moe")


@pytest.mark.timeout(120)
def test_world_mismatch_engine_groups_and_errors():
    run_ranks(4, check_errors_and_engine_groups, timeout_s=100)


def check_pair_control(rank: int, world: int) -> None:
    pc = _config(world, 1, 1, "replicated", nnodes=2, draft_nodes=(1,))
    assert Groups.pair_control(pc) is dist.group.WORLD  # a gloo world carries the control messages itself
    # Under NCCL the messages need a gloo group over the whole world, target ranks included.
    with mock.patch("epdraft.parallel.groups.resolve_backend", return_value=("cuda", "nccl")):
        control = Groups.pair_control(pc)
    assert control is not dist.group.WORLD and dist.get_backend(control) == "gloo"
    assert dist.get_process_group_ranks(control) == list(range(world))
    check_all_reduce(control, "pairs")


@pytest.mark.timeout(120)
def test_pair_control_group_spans_the_world_on_gloo():
    run_ranks(2, check_pair_control, timeout_s=100)


def test_resolve_backend_and_layout_table():
    pc = _config(4, 2, 2, "gather")
    assert resolve_backend(pc) == ("cpu", "gloo")
    table = layout_table(pc).splitlines()
    assert "moe_dp 1 x moe_ep 2 x moe_tp 2" in table[0]
    # rank 2: node 0, ep 1, tp 0, moe rank 2
    assert table[2 + 2].split() == ["2", "0", "2", "both", "0", "1", "0", "2"]
    disagg = layout_table(_config(4, 2, 1, "alltoall", 2, (1,))).splitlines()
    assert disagg[2].split() == ["0", "0", "0", "target"]
    assert disagg[5].split() == ["3", "1", "1", "draft", "0", "1", "0", "1"]
    if not torch.cuda.is_available():
        cuda = parallel_config_from_dict({**pc.to_dict(), "cluster": {**pc.to_dict()["cluster"], "device": "cuda"}})
        with pytest.raises(ParallelError, match="cluster.device = 'cuda' but torch sees no CUDA"):
            resolve_backend(cuda)


def _sockets() -> int:
    """Open sockets of this process (gloo holds one per peer of every group it is in)."""
    fd_dir = Path("/proc/self/fd")
    count = 0
    for fd in fd_dir.iterdir():
        try:
            count += os.readlink(fd).startswith("socket:")
        except OSError:
            continue
    return count


def check_one_group_per_membership(rank: int, world: int, config: str) -> tuple[list[tuple[int, ...]], int, dict]:
    from epdraft.config.parallel import load_parallel_config

    pc = load_parallel_config(CONFIGS / config)
    made = []
    new_group = dist.new_group

    def counting_new_group(ranks=None, *args, **kwargs):
        made.append(tuple(ranks))
        return new_group(ranks, *args, **kwargs)

    before = _sockets()
    with mock.patch.object(dist, "new_group", counting_new_group):
        groups = Groups.from_config(pc)
    health_check(groups)  # connects whatever a group connects lazily
    sockets = _sockets() - before
    same = {name: getattr(groups, name) is dist.group.WORLD for name in ("moe", "attn_dp", "cpu")}
    return made, sockets, same


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config, world, expected", [
    ("local-cpu-2.toml", 2, [(0,), (1,)]),  # moe_dp = moe_tp = 1: one-rank groups; the rest is the world
    ("local-cpu-4.toml", 4, [(0,), (1,), (2,), (3,), (0, 2), (1, 3), (0, 1), (2, 3)]),  # moe_dp, moe_ep, moe_tp
])  # fmt: skip
def test_one_group_per_distinct_membership(config, world, expected):
    results = run_ranks(world, check_one_group_per_membership, config, timeout_s=100)
    for rank, (made, sockets, same) in enumerate(results):
        assert made == expected, (rank, made)
        assert same == {"moe": True, "attn_dp": True, "cpu": True}, (rank, same)
        # A gloo group holds a listening socket and one per peer; the world's group was there
        # before. Building each identical W-rank group anew cost 8 sockets at W = 2, 13 at W = 4.
        assert sockets <= sum(len(m) for m in made if rank in m), (rank, sockets, made)
