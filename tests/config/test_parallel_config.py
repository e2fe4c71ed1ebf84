"""ParallelConfig: the shipped configs load, formats agree, overrides apply, and bad input names its key."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from epdraft.config.parallel import (
    SHIPPED_CONFIGS,
    ParallelConfig,
    apply_overrides,
    check_standalone_target,
    load_parallel_config,
    parallel_config_from_dict,
    resolve_config_path,
    shipped_config_names,
)
from epdraft.errors import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))

BASE = {
    "cluster": {"nnodes": 1, "nproc_per_node": 4, "device": "cpu", "backend": "gloo", "timeout_s": 30},
    "draft": {"attn_dp": 4, "moe_layout": "gather", "moe_ep": 2, "moe_tp": 2},
    "target": {"tp": 1, "dp": 4},
    "placement": {"mode": "colocated"},
}

BASE_TOML = """
[cluster]
nnodes = 1
nproc_per_node = 4
device = "cpu"
backend = "gloo"
timeout_s = 30

[draft]
attn_dp = 4
moe_layout = "gather"
moe_ep = 2
moe_tp = 2

[target]
tp = 1
dp = 4
"""


def test_configs_directory_has_the_five_layouts():
    assert {p.name for p in CONFIGS} >= {
        "local-cpu-2.toml",
        "local-cpu-4.toml",
        "h200x8-dp8-ep8.toml",
        "2node-h200x16-dp16-ep16.toml",
        "2node-disaggregated.toml",
    }


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    pc = load_parallel_config(path)
    assert path.read_text().startswith("#"), "each config opens with a comment saying when to use it"
    assert pc.draft.attn_dp == pc.draft_world_size
    assert pc.target.tp * pc.target.dp == pc.target_world_size
    assert pc.draft.attn_dp % (pc.draft.moe_ep * pc.draft.moe_tp) == 0
    check_standalone_target(pc, source=path.name)  # configs/ hold only what the runner runs


def test_a_sharded_target_is_refused_for_the_runner_naming_the_key_and_file():
    pc = parallel_config_from_dict({**BASE, "target": {"tp": 2, "dp": 2}})
    with pytest.raises(ConfigError) as e:
        check_standalone_target(pc, source="deploy.toml")
    assert str(e.value) == ("deploy.toml: target.tp = 2: the standalone runner loads the whole HF target on every "
                            "target rank (a tensor-parallel target is not implemented); set target.tp = 1 and "
                            "target.dp = 4")  # fmt: skip
    check_standalone_target(parallel_config_from_dict(BASE), source="deploy.toml")


def test_disaggregated_config_places_draft_on_node_1():
    pc = load_parallel_config(next(p for p in CONFIGS if p.name == "2node-disaggregated.toml"))
    assert pc.world_size == 16
    assert pc.draft_ranks == tuple(range(8, 16))
    assert pc.target_ranks == tuple(range(8))
    assert pc.draft.moe_dp == 1


def test_a_shipped_config_is_found_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_config_path("local-cpu-4") == SHIPPED_CONFIGS / "local-cpu-4.toml"
    assert load_parallel_config("local-cpu-4", ["draft.moe_ep=2"]) == load_parallel_config(
        SHIPPED_CONFIGS / "local-cpu-4.toml", ["draft.moe_ep=2"]
    )
    assert shipped_config_names() == tuple(p.stem for p in CONFIGS)
    with pytest.raises(ConfigError, match=rf"{SHIPPED_CONFIGS / 'local-cpu-4.toml'} \(with --set draft.moe_ep=3\)"):
        load_parallel_config("local-cpu-4", ["draft.moe_ep=3"])


def test_a_path_is_read_relative_to_the_working_directory_before_any_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local-cpu-4.toml").write_text(BASE_TOML.replace("moe_tp = 2", "moe_tp = 1"))
    assert load_parallel_config("local-cpu-4.toml").draft.moe_tp == 1
    (tmp_path / "local-cpu-4").write_text(BASE_TOML)  # an existing file is read, never swapped for the name
    with pytest.raises(ConfigError, match="^local-cpu-4: unknown config format ''"):
        load_parallel_config("local-cpu-4")
    with pytest.raises(ConfigError, match=r"^configs/local-cpu-4.toml: cannot read the parallel config: No such file "
                       r"or directory \(relative to the working directory; a shipped config is named without "
                       r"directory or suffix: 2node-disaggregated, .*, local-cpu-4"):  # fmt: skip
        load_parallel_config("configs/local-cpu-4.toml")


def test_an_unknown_name_lists_the_shipped_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = ", ".join(p.stem for p in CONFIGS)
    with pytest.raises(ConfigError) as e:
        load_parallel_config("local-cpu-9")
    assert str(e.value) == f"no config 'local-cpu-9': not a file, and the shipped configs are {names}"
    assert names.startswith("2node-disaggregated, ") and names.endswith(", local-cpu-disagg")


def test_toml_yaml_json_and_dict_agree(tmp_path):
    (tmp_path / "c.toml").write_text(BASE_TOML)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(BASE))
    (tmp_path / "c.json").write_text(json.dumps(BASE))
    loaded = {load_parallel_config(tmp_path / f"c.{ext}") for ext in ("toml", "yaml", "json")}
    loaded.add(parallel_config_from_dict(BASE))
    assert len(loaded) == 1
    pc = loaded.pop()
    assert (pc.world_size, pc.draft.moe_dp, pc.draft.moe_group_size) == (4, 1, 4)
    assert pc.draft_ranks == pc.target_ranks == (0, 1, 2, 3)
    assert pc.to_dict()["draft"]["moe_tp"] == 2


def test_overrides_take_precedence_and_parse_values(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(BASE_TOML)
    pc = load_parallel_config(
        path, ["cluster.nnodes=2", "cluster.nproc_per_node=2", "draft.moe_layout=alltoall", "draft.moe_tp=1"]
    )
    assert (pc.cluster.nnodes, pc.cluster.nproc_per_node, pc.world_size) == (2, 2, 4)
    assert (pc.draft.moe_layout, pc.draft.moe_ep, pc.draft.moe_tp) == ("alltoall", 2, 1)
    d = apply_overrides(BASE, ["placement.draft_nodes=[1]", 'draft.dp_padding="sum_len"', "cluster.timeout_s=2.5"])
    assert d["placement"]["draft_nodes"] == [1] and d["draft"]["dp_padding"] == "sum_len"
    assert d["cluster"]["timeout_s"] == 2.5
    assert BASE["cluster"]["timeout_s"] == 30, "apply_overrides must not mutate its input"


def test_override_error_names_the_override(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(BASE_TOML)
    with pytest.raises(ConfigError, match=r"--set draft.moe_ep=3\).*draft.moe_ep = 3"):
        load_parallel_config(path, ["draft.moe_ep=3"])
    for bad in ("draft.moe_ep", "moe_ep=2", "draft.=2", "a.b.c=1"):
        with pytest.raises(ConfigError, match="expected section.key=value"):
            apply_overrides(BASE, [bad])


def _set(d: dict, dotted: str, value) -> None:
    section, key = dotted.split(".")
    d.setdefault(section, {})[key] = value


def _delete(d: dict, dotted: str) -> None:
    section, key = dotted.split(".")
    del d[section][key]


# (changes to BASE, the key path the message must name, more text it must contain)
MALFORMED = [
    pytest.param({"draft.attn_dp": 3}, "draft.attn_dp = 3", "must equal the draft world size 4", id="wrong-product"),
    pytest.param({"draft.moe_epp": 2}, "draft.moe_epp", "unknown key", id="unknown-key"),
    pytest.param({"drafts.attn_dp": 4}, "drafts", "unknown key", id="unknown-section"),
    pytest.param({"draft.moe_ep": "two"}, "draft.moe_ep = 'two'", "expected `int`, got `str`", id="wrong-type"),
    pytest.param({"cluster.nnodes": True}, "cluster.nnodes = True", "got `bool`", id="bool-for-int"),
    pytest.param({"cluster.nproc_per_node": -1}, "cluster.nproc_per_node = -1", ">= 1", id="negative-size"),
    pytest.param({"cluster.timeout_s": 0}, "cluster.timeout_s = 0", "> 0", id="zero-timeout"),
    pytest.param({"cluster.hang_timeout_s": 30}, "cluster.hang_timeout_s = 30",
                 "expected seconds in [2, cluster.timeout_s = 30)", id="hang-timeout-not-below-timeout"),
    pytest.param({"cluster.hang_timeout_s": 0.5}, "cluster.hang_timeout_s = 0.5",
                 "e.g. --set cluster.hang_timeout_s=7.5",
                 id="hang-timeout-too-short"),
    pytest.param({"cluster.timeout_s": 10}, "cluster.hang_timeout_s = 20", "cluster.timeout_s = 10",
                 id="default-hang-timeout-over-a-short-timeout"),
    pytest.param({"draft.moe_ep": 3, "draft.moe_tp": 1}, "draft.moe_ep = 3", "must divide draft.attn_dp = 4",
                 id="ep-not-dividing"),
    pytest.param({"draft.moe_tp": 3, "draft.moe_ep": 1}, "draft.moe_tp = 3", "must divide", id="tp-not-dividing"),
    pytest.param({"cluster.backend": "nccl"}, "cluster.backend = 'nccl'", "needs CUDA", id="nccl-on-cpu"),
    pytest.param({"draft.moe_layout": "alltoall", "draft.moe_tp": 1, "draft.a2a_backend": "deepep"},
                 "draft.a2a_backend = 'deepep'", "needs CUDA", id="deepep-on-cpu"),
    pytest.param({"cluster.device": "cuda", "draft.a2a_backend": "mooncake"}, "draft.a2a_backend = 'mooncake'",
                 "only applies to draft.moe_layout = 'alltoall'", id="mooncake-a2a-with-gather"),
    pytest.param({"cluster.device": "cuda", "cluster.backend": "nccl", "draft.moe_layout": "alltoall", "draft.moe_tp": 1,
                  "draft.a2a_backend": "deepep", "draft.low_latency": True, "draft.max_rows_per_rank": 0},
                 "draft.max_rows_per_rank = 0", "'deepep' (low_latency) sizes fixed buffers", id="deepep-ll-no-rows"),
    pytest.param({"cluster.device": "cuda", "cluster.backend": "nccl", "draft.moe_layout": "alltoall", "draft.moe_tp": 1,
                  "draft.a2a_backend": "mooncake", "draft.max_rows_per_rank": 0},
                 "draft.max_rows_per_rank = 0", "'mooncake' sizes fixed buffers", id="mooncake-ep-no-rows"),
    pytest.param({"draft.moe_layout": "alltoall"}, "draft.moe_tp = 2",
                 "alltoall supports moe_tp = 1; use gather for expert-TP", id="alltoall-with-tp"),
    pytest.param({"draft.moe_layout": "replicated", "draft.moe_tp": 1}, "draft.moe_ep = 2", "'replicated'",
                 id="replicated-with-ep"),
    pytest.param({"draft.moe_layout": "ring"}, "draft.moe_layout = 'ring'", "'gather'", id="bad-enum"),
    pytest.param({"-draft.attn_dp": None}, "draft.attn_dp", "required key is missing", id="missing-key"),
    pytest.param({"target.tp": 2}, "target.tp x target.dp = 2 x 4", "target world size 4", id="target-product"),
    pytest.param({"placement.mode": "disaggregated"}, "placement.draft_nodes", "must list the nodes",
                 id="disaggregated-without-nodes"),
    pytest.param({"placement.draft_nodes": [0]}, "placement.draft_nodes = [0]", "only applies to",
                 id="draft-nodes-when-colocated"),
    pytest.param({"cluster.nnodes": 2, "cluster.nproc_per_node": 2, "draft.attn_dp": 2, "draft.moe_tp": 1,
                  "target.dp": 2, "placement.mode": "disaggregated", "placement.draft_nodes": [2]},
                 "placement.draft_nodes[0] = 2", "not a node index in [0, cluster.nnodes = 2)", id="node-out-of-range"),
    pytest.param({"placement.draft_nodes": [-1]}, "placement.draft_nodes[0] = -1", ">= 0", id="negative-node"),
    pytest.param({"cluster.nnodes": 2, "cluster.nproc_per_node": 2, "draft.attn_dp": 4,
                  "placement.mode": "disaggregated", "placement.draft_nodes": [0, 1]},
                 "placement.draft_nodes = [0, 1]", "leaves no node for the target", id="no-node-for-target"),
    pytest.param({"draft": 4}, "draft = 4", "expected `object`", id="section-not-a-table"),
]  # fmt: skip


@pytest.mark.parametrize("changes,key,text", MALFORMED)
def test_malformed_config_names_file_key_and_expectation(tmp_path, changes, key, text):
    d = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        if dotted.startswith("-"):
            _delete(d, dotted[1:])
        elif "." in dotted:
            _set(d, dotted, value)
        else:
            d[dotted] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError) as e:
        load_parallel_config(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: "), msg
    assert key in msg, msg
    assert text in msg, msg


def test_deepep_normal_kernels_take_no_row_cap():
    """DeepEP's normal kernels chunk any row count through their buffers: max_rows_per_rank = 0 is
    theirs to ignore (the low-latency and Mooncake cases above are refused)."""
    d = apply_overrides(BASE, ["cluster.device=cuda", "cluster.backend=nccl", "draft.moe_layout=alltoall",
                               "draft.moe_tp=1", "draft.a2a_backend=deepep", "draft.max_rows_per_rank=0"])  # fmt: skip
    assert parallel_config_from_dict(d).draft.max_rows_per_rank == 0


def test_mooncake_transfer_needs_mooncake(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mooncake" else real(name, *a))
    d = apply_overrides(
        BASE,
        ["cluster.nnodes=2", "cluster.nproc_per_node=2", "draft.attn_dp=2", "draft.moe_tp=1", "target.dp=2",
         "placement.mode=disaggregated", "placement.draft_nodes=[1]", "placement.transfer=mooncake"],
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"placement.transfer = 'mooncake'.*pip install 'epdraft\[mooncake\]'"):
        parallel_config_from_dict(d, source="x.toml")
    monkeypatch.undo()
    if real("mooncake") is not None:
        assert parallel_config_from_dict(d).placement.transfer == "mooncake"


def test_unreadable_files_name_the_file(tmp_path):
    bad_toml = tmp_path / "syntax.toml"
    bad_toml.write_text("[cluster\nnnodes = 1")
    with pytest.raises(ConfigError, match=rf"{bad_toml}: not valid TOML"):
        load_parallel_config(bad_toml)
    (tmp_path / "c.ini").write_text(BASE_TOML)
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'c.ini'}: unknown config format '.ini'; expected .toml"):
        load_parallel_config(tmp_path / "c.ini")
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'missing.toml'}: cannot read the parallel config: No such"):
        load_parallel_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'missing'}: cannot read the parallel config: No such"):
        load_parallel_config(tmp_path / "missing")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError, match=rf"{empty}: expected a table of sections"):
        load_parallel_config(empty)


def test_direct_construction_is_validated_too():
    pc = parallel_config_from_dict(BASE)
    with pytest.raises(ConfigError, match="draft.attn_dp = 4 must equal the draft world size 8"):
        ParallelConfig(cluster=type(pc.cluster)(nnodes=2, nproc_per_node=4), draft=pc.draft, target=pc.target)


def test_a_yaml_config_without_pyyaml_names_the_extra(tmp_path, monkeypatch):
    """PyYAML is an extra: without it a YAML config is refused naming the install, TOML still loads."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(BASE))
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: a YAML config needs PyYAML: pip install 'epdraft[yaml]'")):
        load_parallel_config(path)
