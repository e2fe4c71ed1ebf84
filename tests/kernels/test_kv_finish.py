"""The K=V row's finish launch (`epdraft.kernels.step.kv_finish`) on CPU: its shape and dtype checks
(no Triton needed), which draft layers take it, and, where Triton is installed, its arithmetic under
Triton's interpreter against the torch chain (tools/kv_finish_interpret.py, in a subprocess: the
interpreter is chosen by TRITON_INTERPRET when the kernel is defined). On the device:
tests/gpu/test_deepseek_kernels.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epdraft.errors import ConfigError
from epdraft.kernels.step.kv_finish import kv_finish, kv_finish_store
from epdraft.layers.step_kernels import StepKernels
from epdraft.models.deepseek_attention import DeepseekDSparkAttention
from epdraft.models.deepseek_dspark import DeepseekDSparkDraft
from epdraft.models.spec import DraftModelSpec
from tests.models.test_deepseek_dspark import tiny_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (for its interpreter)")
def test_the_launch_equals_the_torch_chain_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}  # fmt: skip
    run = subprocess.run([sys.executable, str(REPO / "tools" / "kv_finish_interpret.py")], capture_output=True,
                         text=True, timeout=280, cwd=REPO, env=env)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.rstrip().endswith("all equal")


def test_bad_shapes_and_dtypes_raise_naming_the_tensors():
    kv, cos = torch.zeros(3, 16), torch.zeros(3, 2)
    with pytest.raises(ConfigError, match=r"kv_finish: kv \(3, 16\), cos \(3, 9\): expected cos and sin \[3, R / 2\]"):
        kv_finish(kv, torch.zeros(3, 9), torch.zeros(3, 9), fake_quant=True)
    with pytest.raises(ConfigError, match=r"kv_finish: kv \(3, 16\), cos \(2, 2\)"):
        kv_finish(kv, torch.zeros(2, 2), torch.zeros(2, 2), fake_quant=True)
    with pytest.raises(ConfigError, match="cos torch.float64, sin torch.float64: expected a float kv and fp32 cos"):
        kv_finish(kv, cos.double(), cos.double(), fake_quant=False)
    with pytest.raises(ConfigError, match="need a contiguous last dim"):
        kv_finish(torch.zeros(16, 3).T, cos, cos, fake_quant=False)
    ring_error = r"kv_finish_store: ring \(5, 8, 12\) torch.float32: expected a float \[P, W, 16"
    with pytest.raises(ConfigError, match=ring_error):
        kv_finish_store(kv, cos, cos, torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long),
                        torch.zeros(5, 8, 12), fake_quant=True)  # fmt: skip
    index_error = r"slots \(3,\) torch.float32, positions \(2,\) torch.int64: expected integer \[3\]"
    with pytest.raises(ConfigError, match=index_error):
        kv_finish_store(kv, cos, cos, torch.zeros(3), torch.zeros(2, dtype=torch.long), torch.zeros(5, 8, 16),
                        fake_quant=True)  # fmt: skip


def test_gradients_are_refused():
    kv = torch.zeros(3, 16, requires_grad=True)
    with pytest.raises(ConfigError, match="kv_finish: the Triton step kernels have no backward"):
        kv_finish(kv, torch.zeros(3, 2), torch.zeros(3, 2), fake_quant=True)


def test_the_draft_takes_the_launch_with_the_triton_step_ops():
    spec = DraftModelSpec.from_config(tiny_config(variant="v41"))
    for step_ops in ("triton", "torch"):
        kernels = StepKernels(step_ops=step_ops)
        draft = DeepseekDSparkDraft(spec, kernels=kernels)
        assert all(layer.attn.fused_kv == (step_ops == "triton") for layer in draft.layers)
    attn = DeepseekDSparkAttention(32, 4, 8, 16, 4, 2, 8, rope_theta=1e4, rms_norm_eps=1e-6, q_norm=False)
    with pytest.raises(ConfigError, match="store_context_kv: this attention was built without fused_kv"):
        attn.store_context_kv(torch.zeros(2, 32), attn.rope(torch.arange(2)), torch.zeros(2, dtype=torch.long),
                              torch.arange(2), torch.zeros(3, 8, 16))  # fmt: skip
