"""A DeepSeek DSpark draft read out of its target's checkpoint (issue 32): `load_draft` on a tiny DeepSeek-V4-layout
target checkpoint bundling the draft under `mtp.*` (tools/make_deepseek_dspark_draft.py --bundle: FP8 linears, FP4
experts, three shards and their index, the first holding only the target's tensors) opens only the shards holding
`mtp.*`, reads none of the target's tensors and, under EP, none of the other ranks' experts' bytes: every read is
counted at the safetensors handle (`epdraft.loading.source.safe_open`), the reader the runner's ranks use too. The
draft-only export of the same tensors (--quantized) loads to the same weights."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import epdraft.loading.source as source_module
from epdraft.layers.step_kernels import StepKernels
from epdraft.loading.quant import dequantize_fp4, dequantize_fp8
from epdraft.models import load_draft, read_draft_spec
from tests.stubs import LocalIdsDispatcher, shard_layout

REPO = Path(__file__).resolve().parents[2]


def _make(out: Path, *flags: str) -> Path:
    made = subprocess.run([sys.executable, str(REPO / "tools" / "make_deepseek_dspark_draft.py"), str(out), *flags],
                          capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert made.returncode == 0, made.stderr
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    return {"bundle": _make(root / "bundle", "--bundle", "--seed", "3"),
            "draft": _make(root / "draft", "--quantized", "--seed", "3")}


class _CountingHandle:
    """A safetensors handle whose slice reads add their bytes to `reads[name]`."""

    def __init__(self, inner, reads):
        self._inner, self._reads = inner, reads

    def get_slice(self, name):
        inner, reads = self._inner.get_slice(name), self._reads

        class _Slice:
            def get_shape(self):
                return inner.get_shape()

            def __getitem__(self, index):
                tensor = inner[index]
                reads[name] += tensor.numel() * tensor.element_size()
                return tensor

        return _Slice()


@pytest.fixture
def counted(monkeypatch):
    """(files opened, bytes read per tensor name) of every safetensors read `load_draft` makes."""
    opened, reads = [], defaultdict(int)

    def counting_open(path, framework):
        opened.append(Path(path).name)
        return _CountingHandle(safe_open(path, framework=framework), reads)

    monkeypatch.setattr(source_module, "safe_open", counting_open)
    return opened, reads


def _stored_bytes(path: Path) -> dict[str, int]:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    sizes = {}
    for file in set(index.values()):
        with safe_open(str(path / file), framework="pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                sizes[name] = t[:].numel() * t[:].element_size()
    return sizes


_EXPERT = re.compile(r"mtp\.\d+\.ffn\.experts\.(\d+)\.w[123]\.(?:weight|scale)")


@pytest.mark.parametrize("ep_rank", [0, 1])
@pytest.mark.parametrize("held", ["dequantized", "quantized"])
def test_ep_rank_reads_only_the_draft_shards_and_its_experts_bytes(checkpoints, counted, ep_rank, held):
    opened, reads = counted
    path = checkpoints["bundle"]
    spec = read_draft_spec(path)
    moe = spec.ffn.layers[0]
    ep_size = 2
    dispatcher = LocalIdsDispatcher(shard_layout(moe, spec.hidden_size, ep_rank=ep_rank, ep_size=ep_size))
    kernels = StepKernels(quantized_experts=True) if held == "quantized" else None
    draft = load_draft(path, spec=spec, dispatcher=dispatcher, kernels=kernels)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    target_only = {f for f in set(index.values()) if not any(n.startswith("mtp.") for n, g in index.items() if g == f)}
    assert target_only == {"model-00001-of-00003.safetensors"}
    assert not set(opened) & target_only and set(opened) <= set(index.values())
    assert all(name.startswith("mtp.") for name in reads), sorted(n for n in reads if not n.startswith("mtp."))
    stored = _stored_bytes(path)
    per_rank = moe.num_experts // ep_size
    mine = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
    experts_read = {n: b for n, b in reads.items() if _EXPERT.fullmatch(n)}
    assert experts_read and all(int(_EXPERT.fullmatch(n).group(1)) in mine for n in experts_read)
    mine_stored = {n: b for n, b in stored.items() if (m := _EXPERT.fullmatch(n)) and int(m.group(1)) in mine}
    assert experts_read == mine_stored  # each of this rank's expert tensors read once, whole; no other expert's
    assert sum(reads.values()) == sum(b for n, b in stored.items() if n.startswith("mtp.") and
                                      (not _EXPERT.fullmatch(n) or n in mine_stored))
    experts = draft.layers[0].mlp.experts
    assert experts.w13.dtype == (torch.uint8 if held == "quantized" else torch.float32)
    assert experts.shard.first == ep_rank * per_rank and experts.shard.count == per_rank


def test_bundled_and_draft_only_exports_load_the_same_weights(checkpoints):
    bundled, alone = load_draft(checkpoints["bundle"]), load_draft(checkpoints["draft"])
    a, b = bundled.state_dict(), alone.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the draft holds the stored tensors' dequantization: an FP8 linear, an FP4 expert's gate rows, the bf16 router
    index = json.loads((checkpoints["bundle"] / "model.safetensors.index.json").read_text())["weight_map"]

    def stored(name):
        with safe_open(str(checkpoints["bundle"] / index[name]), framework="pt") as f:
            return f.get_tensor(name)

    w, s = stored("mtp.0.attn.wq_a.weight"), stored("mtp.0.attn.wq_a.scale")
    assert (w.dtype, s.dtype) == (torch.float8_e4m3fn, torch.float8_e8m0fnu)
    assert torch.equal(a["layers.0.attn.q_a_proj.weight"], dequantize_fp8(w, s, (128, 128), torch.float32))
    w, s = stored("mtp.1.ffn.experts.3.w1.weight"), stored("mtp.1.ffn.experts.3.w1.scale")
    assert w.dtype == torch.int8 and w.shape[1] * 2 == a["layers.1.mlp.experts.w13"].shape[2]
    assert torch.equal(a["layers.1.mlp.experts.w13"][3, : w.shape[0]], dequantize_fp4(w, s, torch.float32))
    assert stored("mtp.1.ffn.gate.weight").dtype == torch.bfloat16


def test_target_checkpoint_without_the_draft_tensors_names_them(checkpoints, tmp_path):
    """A target checkpoint whose index names no `mtp.*` tensors cannot hold the draft: the load lists them missing."""
    path = checkpoints["bundle"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if not n.startswith("mtp.2.")}
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    for file in set(index["weight_map"].values()):
        (tmp_path / file).symlink_to(path / file)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    from epdraft.errors import LoadError

    with pytest.raises(LoadError, match=r"partial export, \d+ missing: .*layers\.2\."):
        load_draft(tmp_path)


def test_preflight_checks_only_the_bundled_draft(checkpoints, counted):
    """The launcher's header-only load and NaN check see the draft's `mtp.*` tensors, never the target-only shard."""
    from epdraft.preflight import check_draft, check_finite

    opened, reads = counted
    spec, weight_map = check_draft(checkpoints["bundle"])
    assert spec.kind == "dspark_v4" and spec.ffn.quantization.expert_dtype == "fp4"
    assert weight_map and all(name.startswith("mtp.") for name in weight_map)
    assert "model-00001-of-00003.safetensors" not in {p.name for p in weight_map.values()}
    assert not opened and not reads  # headers only, read without safe_open
    check_finite(weight_map)
