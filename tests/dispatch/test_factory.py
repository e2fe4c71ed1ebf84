"""MoeLayout.resolve + make_dispatcher: every layout/backend is resolved once and built, or refused
with the reason naming the key, before step 0."""

from __future__ import annotations

import dataclasses
import importlib.util

import msgspec
import pytest
import torch.distributed as dist

from epdraft.config.ffn import DraftDenseFFNSpec, DraftMoeFFNSpec, RouterSpec
from epdraft.config.hf import DraftMixFFNSpec
from epdraft.config.parallel import parallel_config_from_dict
from epdraft.dispatch import MoeLayout, ReplicatedDispatcher, make_dispatcher
from epdraft.dispatch.alltoall import AllToAllDispatcher
from epdraft.dispatch.gather import GatherDispatcher
from epdraft.errors import ConfigError
from tests.harness import run_ranks

H = 16


def _moe(num_experts: int = 8, intermediate: int = 32, top_k: int = 2) -> DraftMoeFFNSpec:
    return DraftMoeFFNSpec(router=RouterSpec(num_experts=num_experts, top_k=top_k), intermediate_size=intermediate)


def _ffn(*layers) -> DraftMixFFNSpec:
    return DraftMixFFNSpec(family="test", hidden_size=H, layers=layers)


def _config(layout: str, ep: int, tp: int, **draft) -> dict:
    return parallel_config_from_dict(
        {
            "cluster": {"nnodes": 1, "nproc_per_node": 2, "device": "cpu", "backend": "gloo"},
            "draft": {"attn_dp": 2, "moe_layout": layout, "moe_ep": ep, "moe_tp": tp, **draft},
            "target": {"dp": 2},
        }
    )


@dataclasses.dataclass(frozen=True)
class _Coordinates:
    """What resolve reads of the groups: here the world is the MoE group (2 ranks)."""

    ep_rank: int
    ep_size: int
    tp_rank: int
    tp_size: int
    moe: dist.ProcessGroup | None
    device_type: str = "cpu"


def _resolve(layout: str, ep: int, tp: int, ffn: DraftMixFFNSpec | None = None, **draft) -> MoeLayout | str:
    g = dist.get_rank()
    groups = _Coordinates(g // tp, ep, g % tp, tp, dist.group.WORLD)
    try:
        return MoeLayout.resolve(_config(layout, ep, tp, **draft), ffn or _ffn(_moe(), _moe()), groups)
    except ConfigError as e:
        return f"ConfigError: {e}"


def _build(layout: MoeLayout | str) -> str:
    if isinstance(layout, str):
        return layout
    try:
        return type(make_dispatcher(layout, dist.group.WORLD)).__name__
    except ConfigError as e:
        return f"ConfigError: {e}"


def _cases(rank: int, world: int) -> dict:
    gather = _resolve("gather", 1, 2, dp_padding="sum_len")
    auto = _resolve("auto", 2, 1)
    wrong_group = msgspec.structs.replace(_resolve("gather", 2, 1), ep_size=4)
    return {
        "gather": (gather.ep_rank, gather.tp_rank, gather.tp_size, gather.dp_padding, gather.label),
        "gather_built": _build(gather),
        "alltoall_built": _build(_resolve("alltoall", 2, 1)),
        "replicated": _resolve("replicated", 1, 1).label,
        "auto": (auto.layout, auto.chosen_by_auto, auto.reason, auto.label),
        "no_moe": _resolve("alltoall", 2, 1, _ffn(DraftDenseFFNSpec(intermediate_size=8))).layout,
        "experts_split": _resolve("gather", 2, 1, _ffn(_moe(num_experts=7))),
        "intermediate_split": _resolve("gather", 1, 2, _ffn(_moe(), _moe(intermediate=33))),
        "layers_disagree": _resolve("gather", 2, 1, _ffn(_moe(), _moe(top_k=3))),
        "group_mismatch": _build(wrong_group),
        "deepep_gloo": _deepep_on_gloo(),
    }


def _deepep_on_gloo() -> str:
    """deepep asked on a gloo group (a CUDA config on a host without CUDA reaches here)."""
    layout = MoeLayout(layout="alltoall", backend="deepep", num_experts=8, hidden_size=H, top_k=2, ep_size=2,
                       ep_rank=dist.get_rank(), max_rows_per_rank=64)  # fmt: skip
    return _build(layout)


@pytest.mark.timeout(60)
def test_layouts_resolve_once_and_build_or_refuse_with_the_key():
    out = run_ranks(2, _cases, timeout_s=50)[1]
    assert out["gather"] == (0, 1, 2, "sum_len", "gather (sum_len)")
    assert out["gather_built"] == GatherDispatcher.__name__
    assert out["alltoall_built"] == AllToAllDispatcher.__name__
    assert out["replicated"] == "replicated"
    layout, by_auto, reason, label = out["auto"]
    assert by_auto and reason.startswith(layout) and label.endswith(", chosen by auto")
    assert out["no_moe"] == "replicated"
    assert out["experts_split"] == "ConfigError: draft.moe_ep = 2 must divide the draft's 7 experts (draft, layer 0)"
    assert out["intermediate_split"] == (
        "ConfigError: draft.moe_tp = 2 must divide the draft's expert intermediate size 33 (draft, layer 1)"
    )
    assert out["layers_disagree"].startswith("ConfigError: layer 1: 8 experts top-3, layer 0: 8 top-2; ")
    assert out["group_mismatch"] == (
        "ConfigError: draft.moe_layout = 'gather' cannot run here: draft.moe_ep = 4 x draft.moe_tp = 1 = 4 ranks, "
        "but the MoE group has 2"
    )
    # The first missing piece is named: the package with its install command, else CUDA.
    if importlib.util.find_spec("deep_ep") is None:
        assert "deep_ep is not installed: pip install sgl-deep-ep built for this torch" in out["deepep_gloo"]
    else:
        assert out["deepep_gloo"].endswith("needs CUDA GPUs and none is visible"), out["deepep_gloo"]
    assert out["deepep_gloo"].startswith("ConfigError: draft.a2a_backend = 'deepep' cannot run here: ")


def test_replicated_needs_no_group():
    layout = MoeLayout.local(8, H, 2)
    assert isinstance(make_dispatcher(layout, None), ReplicatedDispatcher)


def test_unknown_backend_is_refused_naming_both_keys():
    layout = MoeLayout(layout="alltoall", backend="nccl", num_experts=8, hidden_size=H, top_k=2)
    with pytest.raises(ConfigError, match="draft.a2a_backend = 'nccl' with draft.moe_layout = 'alltoall': expected one of"):
        make_dispatcher(layout, None)


def _low_latency(hidden: int = 7168, rows: int = 128, top_k: int = 8) -> MoeLayout:
    return MoeLayout(layout="alltoall", backend="deepep", low_latency=True, max_rows_per_rank=rows, ep_size=2,
                     num_experts=16, hidden_size=hidden, top_k=top_k, device_type="cuda")  # fmt: skip


def test_deepep_low_latency_limits_are_refused_naming_the_key(monkeypatch):
    """DeepEP's low-latency kernels: its hidden sizes (3584 only in SGLang's build), top-k up to 11,
    R*T % 4 == 0, and NVSHMEM_QP_DEPTH >= 2 (T + 1), which its dispatch asserts on every rank at
    the first step (T = 512 under the default depth 1024)."""
    from epdraft.dispatch import deepep

    monkeypatch.delenv("NVSHMEM_QP_DEPTH", raising=False)
    monkeypatch.setattr(deepep, "_sgl_build", lambda: False)
    assert deepep._low_latency_reason(_low_latency(), 2) is None
    assert deepep._low_latency_reason(_low_latency(rows=510), 2) is None
    why = deepep._low_latency_reason(_low_latency(rows=512), 2)
    assert why.startswith("draft.max_rows_per_rank = 512: DeepEP low-latency needs NVSHMEM_QP_DEPTH >= 2 (T + 1) = 1026")
    monkeypatch.setenv("NVSHMEM_QP_DEPTH", "2048")
    assert deepep._low_latency_reason(_low_latency(rows=512), 2) is None
    assert "hidden size 3584" in deepep._low_latency_reason(_low_latency(hidden=3584), 2)
    monkeypatch.setattr(deepep, "_sgl_build", lambda: True)
    assert deepep._low_latency_reason(_low_latency(hidden=3584), 2) is None
    assert "top_k = 12" in deepep._low_latency_reason(_low_latency(top_k=12), 2)
    assert "R*T % 4 == 0 (3 ranks)" in deepep._low_latency_reason(_low_latency(rows=130), 3)
