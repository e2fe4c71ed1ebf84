"""Write a tiny quantized draft (MXFP4 or block-scaled FP8 experts) for tests and `epdraft run` on CPU.

    python tools/make_tiny_quant_draft.py --format mxfp4 --out /tmp/tiny-mxfp4
    python tools/make_tiny_quant_draft.py --format fp8 --layout fused --out /tmp/tiny-fp8
    epdraft run configs/local-cpu-2.toml --draft /tmp/tiny-mxfp4      # dequantized at load, lossless

The geometry is the shipped tiny draft's (`epdraft/assets/tiny-draft`: 2 layers, hidden 128, 8
experts of I = 96, top-2, a gated shared expert). Weights are random (seeded; `--weights DIR` takes
another export's instead, e.g. the trained tiny draft, to keep its acceptance), quantized by
epdraft's own quantizers (`epdraft.loading.quant`):
- mxfp4: routed experts as `..._blocks` / `..._scales` (per expert, or fused
  `experts.gate_up_proj_blocks [E, 2I, H/32, 16]`, `experts.down_proj_blocks [E, H, I/32, 16]`);
  the rest stays fp32 (transformers' mxfp4 converts only experts).
- fp8: every MLP projection (routed and shared experts) as e4m3 `weight` + fp32 `weight_scale_inv`
  per 128 x 128 block (I = 96 makes the blocks partial); the router, shared-expert gate, attention
  and `fc` are listed in `modules_to_not_convert`.
About 1.5 MB (mxfp4) or 1.3 MB (fp8).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from epdraft.loading.quant import quantize_fp8, quantize_mxfp4

TINY_DRAFT = Path(__file__).resolve().parent.parent / "epdraft" / "assets" / "tiny-draft"
FP8_BLOCK = (128, 128)
NOT_CONVERTED = ["fc", "layers.*.self_attn", "layers.*.mlp.gate", "layers.*.mlp.shared_expert_gate"]


def random_like(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Same names and shapes: norms 1, matrices N(0, 1/fan_in)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in sorted(tensors.items()):
        if t.dim() == 1:
            out[name] = torch.ones_like(t)
        else:
            out[name] = torch.randn(t.shape, generator=gen) * t.shape[-1] ** -0.5
    return out


def _expert_tensors(tensors: dict[str, torch.Tensor], layer: int, num_experts: int) -> dict[str, torch.Tensor]:
    """Stacked gate_up [E, 2I, H] (gate rows first) and down [E, H, I] of one layer's per-expert tensors."""
    p = f"layers.{layer}.mlp.experts."
    gate = torch.stack([tensors.pop(f"{p}{e}.gate_proj.weight") for e in range(num_experts)])
    up = torch.stack([tensors.pop(f"{p}{e}.up_proj.weight") for e in range(num_experts)])
    down = torch.stack([tensors.pop(f"{p}{e}.down_proj.weight") for e in range(num_experts)])
    return {"gate_up_proj": torch.cat([gate, up], dim=1), "down_proj": down}


def quantize_draft(tensors: dict[str, torch.Tensor], config: dict, fmt: str, layout: str) -> dict[str, torch.Tensor]:
    """The export's tensors with its experts (and, for fp8, its shared experts) quantized."""
    tensors = dict(tensors)
    num_experts, I = config["n_routed_experts"], config["moe_intermediate_size"]
    out: dict[str, torch.Tensor] = {}

    def put(name: str, weight: torch.Tensor) -> None:
        if fmt == "mxfp4":
            blocks, scales = quantize_mxfp4(weight)
            out[f"{name}_blocks"], out[f"{name}_scales"] = blocks.contiguous(), scales.contiguous()
        else:
            q, scale = quantize_fp8(weight, FP8_BLOCK)
            out[name], out[f"{name}_scale_inv"] = q.contiguous(), scale.contiguous()

    for layer in range(config["num_hidden_layers"]):
        p = f"layers.{layer}.mlp."
        fused = _expert_tensors(tensors, layer, num_experts)
        if layout == "fused":
            put(f"{p}experts.gate_up_proj", fused["gate_up_proj"])
            put(f"{p}experts.down_proj", fused["down_proj"])
        else:
            for e in range(num_experts):
                put(f"{p}experts.{e}.gate_proj.weight", fused["gate_up_proj"][e, :I])
                put(f"{p}experts.{e}.up_proj.weight", fused["gate_up_proj"][e, I:])
                put(f"{p}experts.{e}.down_proj.weight", fused["down_proj"][e])
        if fmt == "fp8":
            for proj in ("gate_proj", "up_proj", "down_proj"):
                put(f"{p}shared_expert.{proj}.weight", tensors.pop(f"{p}shared_expert.{proj}.weight"))
    return {**out, **{n: t.contiguous() for n, t in tensors.items()}}


def quantization_config(fmt: str) -> dict:
    if fmt == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": ["fc", "layers.*.self_attn", "layers.*.mlp.gate"]}
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(FP8_BLOCK), "modules_to_not_convert": NOT_CONVERTED}


def make(out: Path, fmt: str, layout: str = "per-expert", weights: Path | None = None, seed: int = 0) -> Path:
    """Write `out/config.json` and `out/model.safetensors`; returns `out`."""
    config = json.loads((TINY_DRAFT / "config.json").read_text())
    source = weights if weights is not None else TINY_DRAFT
    tensors = load_file(str(source / "model.safetensors"))
    if weights is None:
        tensors = random_like(tensors, seed)
    config["quantization_config"] = quantization_config(fmt)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(quantize_draft(tensors, config, fmt, layout), str(out / "model.safetensors"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--format", choices=("mxfp4", "fp8"), required=True)
    parser.add_argument("--layout", choices=("per-expert", "fused"), default="per-expert",
                        help="expert tensor names: experts.{i}.*_proj.weight or fused experts.gate_up_proj / down_proj")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--weights", type=Path, default=None,
                        help="quantize this export's weights (same geometry) instead of random ones")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = make(args.out, args.format, args.layout, args.weights, args.seed)
    size = (path / "model.safetensors").stat().st_size
    print(f"{path}: {args.format} {args.layout} draft, model.safetensors {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
