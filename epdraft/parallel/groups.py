"""Groups: every process group the draft needs, built once from a ParallelConfig on a named DeviceMesh.

The draft ranks form a 3-axis mesh `(moe_dp, moe_ep, moe_tp)`, row-major, so draft rank
`(dp_idx * ep + ep_rank) * tp + tp_rank` (for colocated layouts this is the global rank) and, inside
the MoE group, rank `g = ep_rank * tp + tp_rank` (the ordering `MoeLayout` shards experts by).

    groups = Groups.from_config(pc)     # the only caller of new_group (one group per distinct member list)
    layout = MoeLayout.resolve(pc, draft_spec.ffn, groups)
    d = make_dispatcher(layout, groups.moe)

Groups are passed to whoever communicates; nothing below the runtime reads a global group.
"""

from __future__ import annotations

import dataclasses
import datetime
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from epdraft.config.parallel import ClusterConfig, ParallelConfig
from epdraft.config.parallel import CUDA_A2A_BACKENDS
from epdraft.errors import ConfigError, ParallelError

MESH_AXES = ("moe_dp", "moe_ep", "moe_tp")
GROUP_NAMES = ("moe", "moe_ep", "moe_tp", "attn_dp", "cpu")


def resolve_backend(pc: ParallelConfig) -> tuple[str, str]:
    """Return `(device_type, backend)` for this machine, resolving `auto` (CUDA if present).

    Raises ParallelError when the config asks for CUDA that is not there, and ConfigError when
    `auto` resolves to CPU under a draft backend that needs CUDA.
    """
    cluster: ClusterConfig = pc.cluster
    has_cuda = torch.cuda.is_available()
    device = cluster.device if cluster.device != "auto" else ("cuda" if has_cuda else "cpu")
    if device == "cuda" and not has_cuda:
        raise ParallelError("cluster.device = 'cuda' but torch sees no CUDA device on this host")
    backend = cluster.backend if cluster.backend != "auto" else ("nccl" if device == "cuda" else "gloo")
    if backend == "nccl" and device != "cuda":
        raise ConfigError("cluster.backend = 'nccl' needs CUDA but cluster.device = 'auto' resolved to 'cpu'")
    if device == "cpu" and pc.draft.a2a_backend in CUDA_A2A_BACKENDS:
        raise ConfigError(
            f"draft.a2a_backend = {pc.draft.a2a_backend!r} needs CUDA but cluster.device = 'auto' resolved to 'cpu'"
        )
    return device, backend


class _GroupMaker:
    """Makes one process group per distinct member list (and backend), and hands it out again.

    A mesh's axes and their flattenings often have the same members (at moe_dp = 1 the `moe`,
    `moe_ep` and `attn_dp` groups are all the world): each gloo group of W ranks holds W - 1
    sockets and a thread's worth of state per rank, so identical groups are made once, and the
    world's own group is reused when it has the backend asked for. Group creation is collective:
    every rank calls `slices` in the same order, for groups it is not in too.
    """

    def __init__(self, backend: str, timeout: datetime.timedelta, shared: _GroupMaker | None = None):
        self.backend = backend
        self.timeout = timeout
        self.made: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup] = shared.made if shared is not None else {}
        if dist.get_backend() == backend:
            self.made.setdefault((backend, tuple(range(dist.get_world_size()))), dist.group.WORLD)

    def slices(self, ranks_DET: torch.Tensor, dims: tuple[int, ...], name: str) -> dist.ProcessGroup | None:
        """The group of this rank's slice along `dims` of the rank grid (every slice's group made
        once, by every rank); None when this rank is not in the grid."""
        rest = [i for i in range(ranks_DET.dim()) if i not in dims]
        rows = ranks_DET.permute(*rest, *dims).reshape(-1, math.prod(ranks_DET.shape[i] for i in dims))
        mine = None
        for members in map(tuple, rows.tolist()):
            group = self.made.get((self.backend, members))
            if group is None:
                opts = None
                if self.backend == "nccl":  # NCCL takes its timeout through its options
                    opts = dist.ProcessGroupNCCL.Options()
                    opts._timeout = self.timeout
                group = dist.new_group(list(members), timeout=self.timeout, backend=self.backend, pg_options=opts,
                                       group_desc=f"epdraft_{name}")  # fmt: skip
                self.made[self.backend, members] = group
            if dist.get_rank() in members:
                mine = group
        return mine


@dataclasses.dataclass(frozen=True)
class Groups:
    """This rank's draft process groups and its coordinates in them.

    moe: the ep x tp ranks sharing one copy of the experts (group rank g = ep_rank * tp_size + tp_rank).
    moe_ep / moe_tp: the sub-groups along each axis. From an engine's groups, an axis the engine did not
        pass is `moe` when the other axis has size 1 (same members) and None when it has size 1 itself
        (a one-rank axis needs no communication).
    attn_dp: every draft rank (data-parallel attention); dp_rank / dp_size are this rank's place in it.
    cpu: a gloo group over the attn_dp ranks, for small metadata that must not touch the GPU stream.
    mesh: the DeviceMesh the groups came from, or None when built from an engine's groups.
    device_type: "cuda" or "cpu", where this rank's draft runs.
    """

    mesh: DeviceMesh | None
    moe: dist.ProcessGroup
    moe_ep: dist.ProcessGroup | None
    moe_tp: dist.ProcessGroup | None
    attn_dp: dist.ProcessGroup
    cpu: dist.ProcessGroup
    ep_rank: int
    ep_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    device_type: str

    @classmethod
    def from_config(cls, pc: ParallelConfig) -> Groups | None:
        """Build the mesh and groups; every rank of the world must call this (group creation is collective).

        Returns None on a rank that holds no draft (a target node under `placement.mode = "disaggregated"`).
        Raises ParallelError when the running world does not match the config.
        """
        if not dist.is_initialized():
            raise ParallelError("Groups.from_config needs torch.distributed initialized (run under torchrun)")
        if dist.get_world_size() != pc.world_size:
            raise ParallelError(
                f"the process group has {dist.get_world_size()} ranks but cluster.nnodes x cluster.nproc_per_node "
                f"= {pc.cluster.nnodes} x {pc.cluster.nproc_per_node} = {pc.world_size}"
            )
        device_type, backend = resolve_backend(pc)
        timeout = datetime.timedelta(seconds=pc.cluster.timeout_s)
        d = pc.draft
        ranks_DET = torch.tensor(pc.draft_ranks).view(d.moe_dp, d.moe_ep, d.moe_tp)
        make = _GroupMaker(backend, timeout)
        axis_groups = [make.slices(ranks_DET, (dim,), name) for dim, name in enumerate(MESH_AXES)]
        moe = make.slices(ranks_DET, (1, 2), "moe")
        attn_dp = make.slices(ranks_DET, (0, 1, 2), "attn_dp")
        # Small metadata (reports, the CPU step sync's members) must not touch the GPU stream.
        cpu = attn_dp if backend == "gloo" else _GroupMaker("gloo", timeout, make).slices(ranks_DET, (0, 1, 2), "cpu")
        if dist.get_rank() not in pc.draft_ranks:
            return None
        # A mesh over the groups just made (from_group creates none), for whoever wants mesh axes.
        mesh = DeviceMesh.from_group(axis_groups, device_type, mesh=ranks_DET, mesh_dim_names=MESH_AXES)
        _, ep_rank, tp_rank = mesh.get_coordinate()
        return cls(
            mesh=mesh,
            moe=moe,
            moe_ep=axis_groups[1],
            moe_tp=axis_groups[2],
            attn_dp=attn_dp,
            cpu=cpu,
            ep_rank=ep_rank,
            ep_size=d.moe_ep,
            tp_rank=tp_rank,
            tp_size=d.moe_tp,
            dp_rank=dist.get_rank(attn_dp),
            dp_size=d.attn_dp,
            device_type=device_type,
        )

    @staticmethod
    def pair_control(pc: ParallelConfig) -> dist.ProcessGroup:
        """The group paired target and draft ranks exchange control messages on (disaggregated placement).

        Control messages need tags and CPU tensors: the world group when it is gloo, else a gloo
        group over the world, bounded by `cluster.timeout_s`. Every rank of the world must call this
        (group creation is collective), the target ranks too, which `from_config` returns None to.
        """
        _, backend = resolve_backend(pc)
        if backend == "gloo":
            return dist.group.WORLD
        timeout = datetime.timedelta(seconds=pc.cluster.timeout_s)
        return dist.new_group(backend="gloo", timeout=timeout, group_desc="epdraft_pairs")

    @classmethod
    def from_process_groups(
        cls,
        *,
        moe: dist.ProcessGroup,
        attn_dp: dist.ProcessGroup,
        cpu: dist.ProcessGroup,
        ep_size: int,
        tp_size: int,
        moe_ep: dist.ProcessGroup | None = None,
        moe_tp: dist.ProcessGroup | None = None,
    ) -> Groups:
        """Wrap groups an embedding engine already has; creates no group.

        `moe` must order its ranks g = ep_rank * tp_size + tp_rank. `moe_ep`/`moe_tp` are needed only
        when both sizes exceed 1. Raises ParallelError on sizes that do not fit together.
        """
        if moe.size() != ep_size * tp_size:
            raise ParallelError(f"moe group has {moe.size()} ranks but ep_size x tp_size = {ep_size} x {tp_size}")
        if attn_dp.size() % moe.size() != 0:
            raise ParallelError(f"moe group size {moe.size()} must divide the attn_dp group size {attn_dp.size()}")
        if cpu.size() != attn_dp.size():
            raise ParallelError(f"cpu group has {cpu.size()} ranks but attn_dp has {attn_dp.size()}; they must match")
        if ep_size > 1 and tp_size > 1 and (moe_ep is None or moe_tp is None):
            raise ParallelError(
                f"ep_size = {ep_size} and tp_size = {tp_size}: pass moe_ep (one TP slice's EP ranks) and moe_tp "
                "(one expert shard's TP ranks)"
            )
        if moe_ep is None and tp_size == 1:
            moe_ep = moe
        if moe_tp is None and ep_size == 1:
            moe_tp = moe
        g = dist.get_rank(moe)
        return cls(
            mesh=None,
            moe=moe,
            moe_ep=moe_ep,
            moe_tp=moe_tp,
            attn_dp=attn_dp,
            cpu=cpu,
            ep_rank=g // tp_size,
            ep_size=ep_size,
            tp_rank=g % tp_size,
            tp_size=tp_size,
            dp_rank=dist.get_rank(attn_dp),
            dp_size=attn_dp.size(),
            device_type="cuda" if dist.get_backend(moe) == dist.Backend.NCCL else "cpu",
        )

    def get(self, name: str) -> dist.ProcessGroup:
        """The group called `name`; raises ParallelError listing the valid names."""
        if name not in GROUP_NAMES:
            raise ParallelError(f"no group named {name!r}; valid: {', '.join(GROUP_NAMES)}")
        group = getattr(self, name)
        if group is None:
            raise ParallelError(f"group {name!r} was not passed by the engine (its axis has size 1)")
        return group


def layout_table(pc: ParallelConfig) -> str:
    """A per-rank table of the layout (what rank 0 prints at start), computed from the config alone."""
    d = pc.draft
    lines = [
        f"world {pc.world_size} = {pc.cluster.nnodes} node(s) x {pc.cluster.nproc_per_node}; "
        f"draft: attn_dp {d.attn_dp} = moe_dp {d.moe_dp} x moe_ep {d.moe_ep} x moe_tp {d.moe_tp}, "
        f"moe_layout {d.moe_layout}, a2a_backend {d.a2a_backend}; target: tp {pc.target.tp} x dp {pc.target.dp}; "
        f"placement {pc.placement.mode}",
        f"{'rank':>5} {'node':>5} {'local':>5}  {'role':<7} {'moe_dp':>6} {'moe_ep':>6} {'moe_tp':>6} {'moe_rank':>8}",
    ]
    index = {r: i for i, r in enumerate(pc.draft_ranks)}
    n = pc.cluster.nproc_per_node
    for rank in range(pc.world_size):
        head = f"{rank:>5} {rank // n:>5} {rank % n:>5}"
        if rank not in index:
            lines.append(f"{head}  target")
            continue
        i = index[rank]
        dp_idx, g = divmod(i, d.moe_group_size)
        ep_rank, tp_rank = divmod(g, d.moe_tp)
        role = "draft" if pc.placement.mode == "disaggregated" else "both"
        lines.append(f"{head}  {role:<7} {dp_idx:>6} {ep_rank:>6} {tp_rank:>6} {g:>8}")
    return "\n".join(lines)
