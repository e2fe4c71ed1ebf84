"""StepKernels: each op's implementation resolved once per rank from device, dtype, draft and layout;
the layers and models pick their forward from it at construction, never per call (CPU only: on
CUDA the value is resolved as a host with Triton would, the kernels themselves run in tests/gpu)."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest
import torch

from epdraft.config.ffn import DraftDenseFFNSpec, DraftMoeFFNSpec, RouterSpec
from epdraft.config.hf import DraftMixFFNSpec
from epdraft.config.quant import QuantSpec
from epdraft.dispatch import MoeLayout
from epdraft.errors import ConfigError
from epdraft.kernels import launch
from epdraft.kernels.experts.fused import fused_experts, fused_experts_quantized
from epdraft.layers import DraftMLP, DraftMoE, RoutedExperts, Router
from epdraft.layers.step_kernels import FAMILIES, StepKernels, default_dtype
from epdraft.models import DFlashDraft, DraftModelSpec
from tests.models.helpers import draft_config

H, I = 128, 256
PACKAGE = Path(__file__).resolve().parents[2] / "epdraft"


@pytest.fixture
def triton_here(monkeypatch):
    """Resolve as a host with Triton installed would (this CPU host may lack it)."""
    monkeypatch.setattr(launch, "triton_installed", lambda: True)


def _moe(quantization: QuantSpec | None = None, **router) -> DraftMoeFFNSpec:
    return DraftMoeFFNSpec(router=RouterSpec(num_experts=8, top_k=2, **router), intermediate_size=I,
                           quantization=quantization)  # fmt: skip


def _ffn(*layers) -> DraftMixFFNSpec:
    return DraftMixFFNSpec(family="moe", hidden_size=H, layers=layers)


def _layout(**kw) -> MoeLayout:
    return MoeLayout(**{**dict(layout="replicated", num_experts=8, hidden_size=H, top_k=2, device_type="cuda"), **kw})


def test_cpu_runs_every_op_on_its_torch_path():
    kernels = StepKernels.resolve("cpu", torch.float32, ffn=_ffn(_moe()))
    assert kernels == StepKernels.reference()
    assert kernels.reasons == () and kernels.dequantized is None
    assert kernels.label == ("step ops torch, projections torch, attention torch, experts reference, sampling torch, "
                             "graphs off")
    assert default_dtype("cpu") == torch.float32 and default_dtype("cuda:1") == torch.bfloat16


def test_cuda_bf16_runs_every_kernel(triton_here):
    kernels = StepKernels.resolve("cuda", torch.bfloat16, ffn=_ffn(_moe()), layout=_layout(), graphs=True)
    assert (kernels.step_ops, kernels.projections, kernels.attention, kernels.experts) == (
        "triton", "skinny", "triton", "fused")
    assert kernels.graphs and kernels.side_stream and kernels.reasons == () and not kernels.quantized_experts
    assert kernels.label.endswith("experts fused, sampling triton, graphs on")


def test_cuda_without_triton_says_so(monkeypatch):
    monkeypatch.setattr(launch, "triton_installed", lambda: False)
    kernels = StepKernels.resolve("cuda", torch.bfloat16, ffn=_ffn(_moe()))
    assert kernels == StepKernels(reasons=kernels.reasons, side_stream=True)  # a stream is CUDA's, not Triton's
    assert len(kernels.reasons) == len(FAMILIES) and all("Triton is not installed" in r for r in kernels.reasons)


def test_cuda_float32_runs_the_reference_experts_and_names_the_fix(triton_here):
    kernels = StepKernels.resolve("cuda", torch.float32, ffn=_ffn(_moe()))
    assert (kernels.step_ops, kernels.attention) == ("triton", "triton")
    assert (kernels.projections, kernels.experts) == ("torch", "reference")
    experts = [r for r in kernels.reasons if r.startswith("experts: ")]
    assert len(experts) == 1 and "the draft is float32" in experts[0] and "per-expert reference loop" in experts[0]
    assert "--dtype bfloat16" in experts[0]
    # a dense draft has no experts to run: no warning about them
    dense = StepKernels.resolve("cuda", torch.float32, ffn=_ffn(DraftDenseFFNSpec(intermediate_size=I)))
    assert [r.split(":")[0] for r in dense.reasons] == ["projections"]


def test_graphs_are_refused_where_the_step_cannot_be_captured(triton_here):
    with pytest.raises(ConfigError, match=r"draft\.cuda_graphs = true needs CUDA"):
        StepKernels.resolve("cpu", torch.float32, ffn=_ffn(_moe()), graphs=True)
    host_sync = _layout(layout="alltoall", backend="torch", ep_size=2)
    with pytest.raises(ConfigError, match=r"alltoall dispatch syncs with the host and cannot be captured.*torch_fixed"):
        StepKernels.resolve("cuda", torch.bfloat16, ffn=_ffn(_moe()), layout=host_sync, graphs=True)
    with pytest.raises(ConfigError, match=r"per-expert reference loop, which syncs with the host"):
        StepKernels.resolve("cuda", torch.float32, ffn=_ffn(_moe()), layout=_layout(), graphs=True)
    fixed = _layout(layout="alltoall", backend="torch_fixed", ep_size=2)
    assert StepKernels.resolve("cuda", torch.bfloat16, ffn=_ffn(_moe()), layout=fixed, graphs=True).graphs


def test_quantized_experts_stay_quantized_only_where_the_fused_kernels_take_them(triton_here):
    mx = _ffn(_moe(QuantSpec(method="mxfp4", block=(1, 32))))
    kept = StepKernels.resolve("cuda", torch.bfloat16, ffn=mx, layout=_layout())
    assert kept.quantized_experts and kept.dequantized is None and kept.label.endswith("experts fused (quantized), sampling triton, graphs off")
    sliced = StepKernels.resolve("cuda", torch.bfloat16, ffn=mx, layout=_layout(layout="gather", tp_size=2))
    assert not sliced.quantized_experts
    assert sliced.dequantized == ("mxfp4 checkpoint dequantized to bfloat16 at load (draft.moe_tp = 2 slices the "
                                  "experts; quantized experts are held whole)")
    cpu = StepKernels.resolve("cpu", torch.float32, ffn=mx)
    assert not cpu.quantized_experts and "here cpu, float32" in cpu.dequantized
    fp8_odd = _ffn(msgspec.structs.replace(_moe(QuantSpec(method="fp8", block=(128, 128))), intermediate_size=192))
    assert "I % 128" in StepKernels.resolve("cuda", torch.bfloat16, ffn=fp8_odd).dequantized


def test_layers_pick_their_forward_at_construction():
    """Every module computes as the value it was built with, whatever the device of its tensors."""
    launches = StepKernels(step_ops="triton", projections="skinny", attention="triton", experts="fused")
    assert Router(RouterSpec(num_experts=8, top_k=2), H, kernels=launches).launches
    assert not Router(RouterSpec(num_experts=8, top_k=2, n_group=4, topk_group=2), H, kernels=launches).launches
    assert not Router(RouterSpec(num_experts=8, top_k=2), H, kernels=StepKernels.reference()).launches
    mx = _moe(QuantSpec(method="mxfp4", block=(1, 32)))
    held = DraftMoE(mx, H, kernels=msgspec.structs.replace(launches, quantized_experts=True))
    assert held.experts.quantization is not None and held.experts._compute is fused_experts_quantized
    dequantized = DraftMoE(mx, H, kernels=launches)
    assert dequantized.experts.quantization is None and dequantized.experts._compute is fused_experts
    plain = DraftMoE(_moe(), H, kernels=launches)
    assert plain.experts._compute is fused_experts and plain.router.launches
    assert plain.shared is None and DraftMLP(H, I, kernels=launches).kernels is launches


def test_an_ffn_on_its_torch_chain_refuses_an_epilogue():
    """Only the Triton residual launch writes an epilogue's norm and flag: the torch chain raises
    rather than leave the next layer reading uninitialised rows."""
    from epdraft.kernels.step.ops import Epilogue

    x, residual = torch.randn(3, H), torch.randn(3, H)
    epilogue = Epilogue(torch.ones(H), 1e-6, torch.empty(3, H), torch.zeros(1, dtype=torch.int32))
    for ffn in (DraftMLP(H, I, kernels=StepKernels.reference()), DraftMoE(_moe(), H, kernels=StepKernels.reference())):
        for p in ffn.parameters():  # the layers allocate their weights uninitialised, as a checkpoint fills them
            torch.nn.init.normal_(p, std=0.05)
        with pytest.raises(ConfigError, match=f"{type(ffn).__name__}: an epilogue .* needs the Triton step ops"):
            ffn(x, residual_TH=residual, epilogue=epilogue)
        torch.testing.assert_close(ffn(x, residual_TH=residual), residual + ffn(x))  # without one, as before


def test_ffn_residual_refuses_an_epilogue_it_would_misread():
    """The launch writes the norm as [T, H] rows by their stride and reads H weights and one int32
    flag: a [N, B, H] buffer would be written B rows apart, a short weight read past its end; each
    is refused naming the tensor, before Triton is needed."""
    from epdraft.kernels.step.ops import Epilogue, ffn_residual

    r, y = torch.randn(6, H).bfloat16(), torch.randn(6, H).bfloat16()
    weight, flag = torch.ones(H), torch.zeros(1, dtype=torch.int32)
    bad = {
        rf"normed_TH \(2, 3, {H}\) torch.bfloat16 .*: expected \[6, {H}\] torch.bfloat16": Epilogue(
            weight, 1e-6, torch.empty(2, 3, H).bfloat16(), flag),
        rf"normed_TH \(6, {H}\) torch.float32": Epilogue(weight, 1e-6, torch.empty(6, H), flag),
        rf"norm_weight_H \({H - 1},\): expected \[{H}\]": Epilogue(torch.ones(H - 1), 1e-6, torch.empty_like(r), flag),
        r"nonfinite_1 \(1,\) torch.int64": Epilogue(weight, 1e-6, torch.empty_like(r), torch.zeros(1, dtype=torch.long)),
        "the epilogue's tensors on meta, cpu, cpu": Epilogue(weight, 1e-6, torch.empty_like(r, device="meta"), flag),
    }  # fmt: skip
    for message, epilogue in bad.items():
        with pytest.raises(ConfigError, match="ffn_residual's epilogue: .*" + message):
            ffn_residual(r, y, epilogue=epilogue)


def test_a_draft_hands_one_value_to_every_module():
    kernels = StepKernels(step_ops="triton", attention="triton")
    spec = DraftModelSpec.from_config(draft_config())
    draft = DFlashDraft(spec, kernels=kernels)
    carriers = [m for m in draft.modules() if hasattr(m, "kernels")]
    assert len(carriers) > 3 and all(m.kernels is kernels for m in carriers)
    assert all(m.launch for m in draft.modules() if hasattr(m, "launch"))
    assert not any(m.fused for m in draft.modules() if isinstance(m, RoutedExperts))
    assert DFlashDraft(spec).kernels == StepKernels.resolve("cpu", torch.float32, ffn=spec.ffn)


def test_layers_and_models_decide_nothing_per_call_from_the_device():
    """CONVENTIONS 10b: the device, autograd or CUDA availability are read once, in StepKernels."""
    pattern = re.compile(r"\.is_cuda\b|device\.type\b|is_grad_enabled|cuda\.is_available|use_kernels\(")
    found = [f"{p.relative_to(PACKAGE)}:{i}: {line.strip()}"
             for folder in ("layers", "models") for p in sorted((PACKAGE / folder).rglob("*.py"))
             if p.name != "step_kernels.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]  # fmt: skip
    assert not found, "per-call device decisions outside StepKernels:\n" + "\n".join(found)


def test_deepseek_fp4_experts_held_as_mxfp4_and_fp8_linears_dequantized(triton_here):
    """DeepSeek's released storage: the fp4 experts stay quantized (as mxfp4) where the fused kernels take them,
    its fp8 linears are dequantized at load either way, and the rank's one line says both."""
    q = QuantSpec(method="fp8", block=(128, 128), scale_fmt="ue8m0", expert_dtype="fp4")
    ds = DraftMixFFNSpec(family="moe", hidden_size=H, layers=(_moe(q),), quantization=q)
    kept = StepKernels.resolve("cuda", torch.bfloat16, ffn=ds, layout=_layout())
    assert kept.quantized_experts and kept.dequantized == "fp8 linears dequantized to bfloat16 at load"
    cpu = StepKernels.resolve("cpu", torch.float32, ffn=ds)
    assert not cpu.quantized_experts
    assert cpu.dequantized.startswith("fp4 checkpoint dequantized to float32 at load (")
    assert cpu.dequantized.endswith("; fp8 linears dequantized to float32 at load")
