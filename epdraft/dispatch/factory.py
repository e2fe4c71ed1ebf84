"""make_dispatcher: the one place that knows every layout and backend (the registry below).

Adding an all-to-all backend is three files: its module here (a class with `__init__(layout,
group)`, `unsupported_reason(layout, group)`, dispatch / combine / close), one line in
`REGISTRY`, and its name in `draft.a2a_backend`'s schema (`epdraft/config/parallel.py`). See
docs/dispatch-backends.md.
"""

from __future__ import annotations

import importlib
import logging

import torch.distributed as dist

from epdraft.dispatch.base import Dispatcher, ReplicatedDispatcher
from epdraft.dispatch.layout import MoeLayout
from epdraft.errors import ConfigError

log = logging.getLogger(__name__)

# (layout, a2a backend) -> "module:Class", imported only when built, so a missing optional package
# (DeepEP, Mooncake EP) costs nothing until a config asks for it.
REGISTRY: dict[tuple[str, str], str] = {
    ("gather", "torch"): "epdraft.dispatch.gather:GatherDispatcher",
    ("alltoall", "torch"): "epdraft.dispatch.alltoall:AllToAllDispatcher",
    ("alltoall", "torch_fixed"): "epdraft.dispatch.fixed_alltoall:FixedAllToAllDispatcher",
    ("alltoall", "deepep"): "epdraft.dispatch.deepep:DeepEPDispatcher",
    ("alltoall", "mooncake"): "epdraft.dispatch.mooncake:MooncakeDispatcher",
}


def _dispatcher_class(layout: MoeLayout) -> type:
    entry = REGISTRY.get((layout.layout, layout.backend))
    if entry is None:
        known = sorted({b for lay, b in REGISTRY if lay == layout.layout})
        raise ConfigError(
            f"draft.a2a_backend = {layout.backend!r} with draft.moe_layout = {layout.layout!r}: "
            f"expected one of {', '.join(known)}"
        )
    module, name = entry.split(":")
    return getattr(importlib.import_module(module), name)


def _unsupported_reason(cls: type, layout: MoeLayout, group: dist.ProcessGroup | None) -> str | None:
    """Why backend `cls` cannot run `layout` on `group` here (the group's size, else the backend's own words)."""
    if group is None:
        return f"moe_layout {layout.layout!r} needs the MoE process group"
    if dist.get_world_size(group) != layout.group_size:
        return (
            f"draft.moe_ep = {layout.ep_size} x draft.moe_tp = {layout.tp_size} = {layout.group_size} ranks, "
            f"but the MoE group has {dist.get_world_size(group)}"
        )
    return cls.unsupported_reason(layout, group)


def make_dispatcher(layout: MoeLayout, group: dist.ProcessGroup | None) -> Dispatcher:
    """Build the dispatcher every MoE layer of this rank's draft talks through, over MoE group `group`.

    `layout` comes from `MoeLayout.resolve` (config x draft checked there); `group` is None only
    for "replicated". This is the one place a backend is asked whether it can run (resolve cannot
    ask: this module imports it), so a layout built by hand (tests, `epdraft bench dispatch`) is
    refused the same way. Raises ConfigError naming the key and quoting the backend's reason.
    """
    if layout.layout == "replicated":
        return ReplicatedDispatcher(layout)
    cls = _dispatcher_class(layout)
    reason = _unsupported_reason(cls, layout, group)
    if reason is not None:
        key = "moe_layout = 'gather'" if layout.layout == "gather" else f"a2a_backend = {layout.backend!r}"
        raise ConfigError(f"draft.{key} cannot run here: {reason}")
    log.debug("MoE dispatcher: %s (%s)", layout.label, cls.__name__)
    return cls(layout, group)
