"""`draft.cuda_graphs` resolved by `MoeLayout.resolve`: 'auto' (the default) replays the step from
CUDA graphs exactly where it can (CUDA and a dispatch without host sync), true is refused at
resolution where it cannot run, naming the key."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from epdraft.config.parallel import parallel_config_from_dict
from epdraft.dispatch import MoeLayout
from epdraft.errors import ConfigError
from epdraft.models import read_draft_spec

TINY_DRAFT = Path(__file__).resolve().parents[2] / "epdraft" / "assets" / "tiny-draft"


def _resolve(device_type: str, draft: dict) -> MoeLayout:
    device = "cuda" if device_type == "cuda" else "cpu"
    pc = parallel_config_from_dict({
        "cluster": {"nnodes": 1, "nproc_per_node": 1, "device": device, "backend": "nccl" if device == "cuda" else "gloo"},
        "draft": {"attn_dp": 1, **draft}, "target": {"dp": 1},
    })  # fmt: skip
    # one rank's coordinates: an EP group of 1 needs no process group for the layouts resolved here
    groups = types.SimpleNamespace(ep_rank=0, ep_size=1, tp_rank=0, tp_size=1, device_type=device_type, moe=None)
    return MoeLayout.resolve(pc, read_draft_spec(TINY_DRAFT).ffn, groups)


def test_cuda_graphs_defaults_to_auto():
    assert parallel_config_from_dict({"cluster": {"nnodes": 1, "nproc_per_node": 1}, "draft": {"attn_dp": 1},
                                      "target": {"dp": 1}}).draft.cuda_graphs == "auto"  # fmt: skip


@pytest.mark.parametrize("device_type,layout,expected", [
    ("cuda", "replicated", True),
    ("cpu", "replicated", False),
])  # fmt: skip
def test_auto_takes_graphs_on_cuda_for_a_capturable_dispatch(device_type, layout, expected):
    moe = _resolve(device_type, {"moe_layout": layout})
    assert moe.capturable and moe.cuda_graphs is expected


def test_auto_and_true_for_a_dispatch_that_syncs_with_the_host():
    eager = MoeLayout(layout="alltoall", backend="torch", num_experts=8, hidden_size=64, top_k=2, device_type="cuda")
    assert not eager.capturable
    assert MoeLayout._with_graphs(eager, "auto").cuda_graphs is False
    with pytest.raises(ConfigError, match="draft.cuda_graphs = true"):
        MoeLayout._with_graphs(eager, True)
    fixed = MoeLayout(layout="alltoall", backend="torch_fixed", num_experts=8, hidden_size=64, top_k=2, device_type="cuda")
    assert MoeLayout._with_graphs(fixed, "auto").cuda_graphs is True


def test_explicit_values_are_kept_or_refused():
    assert _resolve("cuda", {"moe_layout": "replicated", "cuda_graphs": False}).cuda_graphs is False
    with pytest.raises(ConfigError, match="draft.cuda_graphs = true"):
        _resolve("cpu", {"moe_layout": "replicated", "cuda_graphs": True})
