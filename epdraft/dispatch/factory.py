"""make_dispatcher: the one place that knows every layout and backend."""

from __future__ import annotations

import logging

import torch.distributed as dist

from epdraft.dispatch.base import Dispatcher, ReplicatedDispatcher
from epdraft.dispatch.setup import DispatchSetup, DpPadding
from epdraft.errors import ConfigError

log = logging.getLogger(__name__)

LAYOUTS = ("replicated", "alltoall", "gather")
A2A_BACKENDS = ("torch", "deepep", "mooncake")


def _backend_class(layout: str, backend: str) -> type:
    if layout == "gather":
        from epdraft.dispatch.gather import GatherDispatcher

        return GatherDispatcher
    if backend == "torch":
        from epdraft.dispatch.alltoall import AllToAllDispatcher

        return AllToAllDispatcher
    if backend == "deepep":
        from epdraft.dispatch.deepep import DeepEPDispatcher

        return DeepEPDispatcher
    if backend == "mooncake":
        from epdraft.dispatch.mooncake import MooncakeDispatcher

        return MooncakeDispatcher
    raise ConfigError(f"draft.a2a_backend = {backend!r}: expected one of {', '.join(A2A_BACKENDS)}")


def make_dispatcher(
    layout: str,
    backend: str,
    group: dist.ProcessGroup | None,
    num_experts: int,
    hidden_size: int,
    *,
    ep_size: int,
    tp_size: int,
    dp_padding: DpPadding = "max_len",
    top_k: int = 0,
    max_tokens_per_rank: int = 0,
    low_latency: bool = False,
) -> Dispatcher:
    """Build the dispatcher of one MoE layer for the MoE group `group` (ep_size * tp_size ranks).

    Args:
        layout: draft.moe_layout, already resolved ("auto" is resolved by
            `epdraft.dispatch.planner.choose_layout` before this call).
        backend: draft.a2a_backend, read for layout "alltoall" only.
        group: the MoE group (None only for "replicated").
        dp_padding: draft.dp_padding for "gather".
        top_k, max_tokens_per_rank: what fixed-buffer backends (deepep, mooncake) check and size.
        low_latency: deepep's low-latency kernels instead of its normal ones.
    Raises:
        ConfigError: unknown layout/backend, a group that does not match ep_size * tp_size, or the
            backend's own unsupported reason, quoted.
    """
    if layout == "replicated":
        return ReplicatedDispatcher()
    if layout not in LAYOUTS:
        hint = " (resolve it with epdraft.dispatch.planner.choose_layout first)" if layout == "auto" else ""
        raise ConfigError(f"draft.moe_layout = {layout!r}: make_dispatcher takes one of {', '.join(LAYOUTS)}{hint}")
    if group is None:
        raise ConfigError(f"draft.moe_layout = {layout!r} needs the MoE process group, got None")
    setup = DispatchSetup(
        num_experts=num_experts,
        hidden_size=hidden_size,
        ep_size=ep_size,
        tp_size=tp_size,
        top_k=top_k,
        dp_padding=dp_padding,
        max_tokens_per_rank=max_tokens_per_rank,
        low_latency=low_latency,
    )
    if dist.get_world_size(group) != setup.group_size:
        raise ConfigError(
            f"draft.moe_ep = {ep_size} x draft.moe_tp = {tp_size} = {setup.group_size} ranks, "
            f"but the MoE group has {dist.get_world_size(group)}"
        )
    if num_experts % ep_size:
        raise ConfigError(f"draft.moe_ep = {ep_size} must divide the draft's {num_experts} experts")
    cls = _backend_class(layout, backend)
    reason = cls.unsupported_reason(setup, group)
    if reason is not None:
        name = "moe_layout = 'gather'" if layout == "gather" else f"a2a_backend = {backend!r}"
        raise ConfigError(f"draft.{name} cannot run here: {reason}")
    log.debug("MoE dispatcher: %s (%s), %s", layout, cls.__name__, setup)
    return cls(setup, group)
