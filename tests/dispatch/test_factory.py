"""make_dispatcher: every layout/backend combination is built or refused with the reason, at build time."""

from __future__ import annotations

import importlib.util

import pytest
import torch.distributed as dist

from epdraft.dispatch import ReplicatedDispatcher, make_dispatcher
from epdraft.dispatch.alltoall import AllToAllDispatcher
from epdraft.dispatch.gather import GatherDispatcher
from epdraft.errors import ConfigError
from tests.harness import run_ranks


def _build(layout: str, backend: str, ep: int, tp: int, **kw):
    try:
        return type(make_dispatcher(layout, backend, dist.group.WORLD, 8, 16, ep_size=ep, tp_size=tp, **kw)).__name__
    except ConfigError as e:
        return f"ConfigError: {e}"


def _factory_cases(rank: int, world: int) -> dict:
    return {
        "gather_ep": _build("gather", "torch", 2, 1),
        "gather_tp_sum": _build("gather", "torch", 1, 2, dp_padding="sum_len"),
        "alltoall": _build("alltoall", "torch", 2, 1),
        "alltoall_tp": _build("alltoall", "torch", 1, 2),
        "deepep_gloo": _build("alltoall", "deepep", 2, 1),
        "mooncake_gloo": _build("alltoall", "mooncake", 2, 1),
        "unknown_backend": _build("alltoall", "nccl", 2, 1),
        "auto": _build("auto", "torch", 2, 1),
        "group_mismatch": _build("gather", "torch", 4, 1),
        "experts_split": _build_bad_experts(),
    }


def _build_bad_experts():
    try:
        make_dispatcher("gather", "torch", dist.group.WORLD, 7, 16, ep_size=2, tp_size=1)
    except ConfigError as e:
        return f"ConfigError: {e}"
    return "built"


@pytest.mark.timeout(60)
def test_factory_builds_or_refuses_with_reason():
    out = run_ranks(2, _factory_cases, timeout_s=50)[0]
    assert out["gather_ep"] == GatherDispatcher.__name__
    assert out["gather_tp_sum"] == GatherDispatcher.__name__
    assert out["alltoall"] == AllToAllDispatcher.__name__
    assert out["alltoall_tp"].startswith("ConfigError: draft.a2a_backend = 'torch' cannot run here: ")
    assert "draft.moe_tp = 2" in out["alltoall_tp"]
    # The first missing piece is named: the package with its install command, else CUDA.
    for key, module, install in (
        ("deepep_gloo", "deep_ep", "pip install 'epdraft[deepep]'"),
        ("mooncake_gloo", "mooncake.mooncake_ep_buffer", "pip install 'epdraft[mooncake-cuda13]'"),
    ):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            assert f"{module} is not installed: {install}" in out[key]
        else:
            assert out[key].endswith("needs CUDA GPUs and none is visible"), out[key]
    assert out["unknown_backend"] == "ConfigError: draft.a2a_backend = 'nccl': expected one of torch, deepep, mooncake"
    assert "choose_layout" in out["auto"]
    assert out["group_mismatch"] == (
        "ConfigError: draft.moe_ep = 4 x draft.moe_tp = 1 = 4 ranks, but the MoE group has 2"
    )
    assert out["experts_split"] == "ConfigError: draft.moe_ep = 2 must divide the draft's 7 experts"


def test_replicated_needs_no_group():
    assert isinstance(make_dispatcher("replicated", "torch", None, 8, 16, ep_size=1, tp_size=1), ReplicatedDispatcher)
