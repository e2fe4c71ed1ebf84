"""The drafts `bench step` times: a preset's draft with random weights, and its twin in DeepSeek's released
storage as the loader holds it, built in memory (issue 32; an 11 B-parameter preset is never written to disk).

DeepSeek releases a DSpark draft's routed experts in FP4 (e2m1 pairs, an e8m0 scale per 32 inputs) and its
linears (attention, shared expert, main_proj) in FP8 e4m3 with an e8m0 scale per block (128 x 128 on V4,
32 x 32 on V4.1's draft). `quantized_twin` builds the draft from that release's spec, so the layers hold what
`load_draft` would hold (`StepKernels` decides: on CUDA the experts stay FP4 as the fused kernels' mxfp4,
re-laid by `RoutedExperts.pack_for_kernels`; the FP8 linears are dequantized at load), and fills it from the
bf16 draft through the project's own quantizers (`loading.quant`): the same weights, as they would come back
from the release. `released_bytes` counts each tensor at its released size, for the floor the FP8 GEMM
would reach (`bench linear` measures that GEMM).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from epdraft.errors import ConfigError
from epdraft.layers.routed_experts import RoutedExperts
from epdraft.layers.step_kernels import StepKernels

FP8_LINEAR = re.compile(
    r"(?:layers\.\d+\.(?:attn\.(?:q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj)|mlp\.shared\.(?:gate|up|down)_proj)"
    r"|main_proj)\.weight"
)
"""A DSpark V4 draft's parameters that DeepSeek releases as FP8 linears (`mtp.{i}.attn.wq_a|wq_b|wkv|wo_a|wo_b`,
`ffn.shared_experts.w1|w2|w3`, `main_proj`; the names `models.deepseek_names` maps them to)."""


def random_draft(spec, *, dtype: torch.dtype, device: torch.device | str, kernels: StepKernels | None = None):
    """The draft of `spec` with random weights: norms 1, every other tensor normal with std 1/sqrt(fan-in)."""
    from epdraft.models.protocol import DRAFT_FAMILIES

    draft = DRAFT_FAMILIES[spec.kind](spec, dtype=dtype, device=device, dispatcher=None, kernels=kernels).eval()
    with torch.no_grad():
        for name, t in draft.named_parameters():
            t.fill_(1.0) if name.endswith("norm.weight") else t.normal_(0.0, t.shape[-1] ** -0.5)
    return draft


def release_block(spec) -> int:
    """The FP8 scale block DeepSeek releases a DSpark draft with: 32 on V4.1's draft, 128 on V4."""
    return 32 if spec.deepseek.variant == "v41" else 128


def plain_config(config: dict) -> dict:
    """A draft config.json without its quantization (the bf16 draft of the same shapes)."""
    return {k: v for k, v in config.items() if k not in ("quantization_config", "expert_dtype")}


def release_config(config: dict, block: int) -> dict:
    """`config` with DeepSeek's released quantization keys (FP8 e4m3 linears with e8m0 scales per block x
    block, FP4 experts), as its release and `tools/make_deepseek_dspark_draft.py --quantized` write them."""
    return {**plain_config(config), "expert_dtype": "fp4", "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
        "weight_block_size": [block, block]}}  # fmt: skip


@torch.no_grad()
def quantized_twin(draft, spec, *, kernels: StepKernels | None = None):
    """`draft` (bf16 or fp32, built from a plain spec) rebuilt from `spec`, its release's quantized spec, with
    the same weights as the release stores and the loader holds them: routed experts quantized to FP4
    (`quantize_weights(..., "mxfp4")`: values and e8m0 scales; dequantized to the draft's dtype where
    `kernels` keeps no quantized experts), FP8 linears quantized to e4m3 with e8m0 block scales and
    dequantized back (what loading does with them), every other tensor copied. `kernels`: the twin's
    compute (None: resolved for the draft's device and dtype, as `load_draft` does).

    Raises ConfigError for a spec without DeepSeek's release quantization (fp8 linears, fp4 experts)."""
    from epdraft.loading.quant import dequantize_fp8, dequantize_weights, quantize_fp8, quantize_weights
    from epdraft.models.protocol import DRAFT_FAMILIES

    q = spec.ffn.quantization
    if spec.deepseek is None or q is None or q.method != "fp8" or q.expert_dtype != "fp4":
        raise ConfigError("the quantized twin is DeepSeek's released DSpark layout: a dspark_v4 spec with fp8 linears "
                          "and expert_dtype fp4 (release_config)")
    source = dict(draft.named_parameters())
    any_param = source["main_proj.weight"]
    twin = DRAFT_FAMILIES[spec.kind](spec, dtype=any_param.dtype, device=any_param.device, dispatcher=None,
                                     kernels=kernels).eval()  # fmt: skip
    experts = {name: m for name, m in twin.named_modules() if isinstance(m, RoutedExperts)}
    for name, p in twin.named_parameters():
        if name.rpartition(".")[0] in experts:
            continue
        w = source[name]
        if FP8_LINEAR.fullmatch(name):
            w = dequantize_fp8(*quantize_fp8(w, q.block, ue8m0=True), q.block, w.dtype)
        p.copy_(w)
    for name, m in experts.items():
        for slot in ("w13", "w2"):
            stored = quantize_weights(source[f"{name}.{slot}"].data, "mxfp4")
            if m.quantization is None:  # the kernels cannot keep them quantized here: dequantized at load
                getattr(m, slot).copy_(dequantize_weights(stored, getattr(m, slot).dtype))
            else:
                getattr(m, slot).copy_(stored.values)
                getattr(m, f"{slot}_scale").copy_(stored.scales)
        m.pack_for_kernels(name)
    return twin


def released_bytes(block: int) -> Callable[[str, torch.Tensor], int]:
    """bytes(name, tensor) of a DSpark V4 draft's tensor as DeepSeek releases it: FP8 linears at one byte a
    weight plus one e8m0 byte per block x block; every other tensor at its held size (the FP4 experts are
    held as released: e2m1 pairs and e8m0 scales)."""

    def nbytes(name: str, t: torch.Tensor) -> int:
        if FP8_LINEAR.fullmatch(name):
            N, K = t.shape[-2:]
            return t.numel() + t.numel() // (N * K) * -(-N // block) * -(-K // block)
        return t.numel() * t.element_size()

    return nbytes


def expert_bytes(experts: RoutedExperts) -> int:
    """Bytes one routed expert's tensors hold (values, scales, biases: each's slice of its leading expert dim)."""
    return sum(t.numel() * t.element_size() // t.shape[0] for t in experts.parameters())

