"""Write a tiny random DeepSeek-V4 (or V4.1) DSpark draft (SpecForge `DSparkV4DraftModel` export) for a target.

    python tools/make_deepseek_dspark_draft.py OUT [--target epdraft/assets/tiny-target] [--seed 0] [--v41]
        [--quantized [--block N]] [--bundle]

hidden = the target's, 4 heads of 32, rope 8, q_lora 16, 2 output groups of rank 16, 8 experts top-2
(sqrtsoftplus, one shared expert), hc_mult 4, window 8, block 5, target_layer_ids [1, 2, 3], vanilla
Markov head of rank 8 and the confidence head. `--v41` writes DeepSeek-V4.1's variant
(`attention_mode: "deepseek_v41"`, the window as `dflash_config.context_window`: no q norm, single-pass
mHC, no `hc_head_*` tensors), laid out from the architecture description (reference draft_models.md 6b),
not from a released V4.1 export. Random weights: about no draft is accepted, decoding
stays lossless. Writes OUT/config.json and OUT/model.safetensors in the export's `mtp.*` names.

`--quantized` writes DeepSeek's released layout with the project's own quantizers
(`epdraft.loading.quant`): FP8 e4m3 linears (attention, shared expert, main_proj) with a float8_e8m0fnu
`.scale` per block (128 x 128; V4.1: 32 x 32; `--block` sets it), FP4 routed experts as int8 pairs
(low nibble first) with an e8m0 `.scale` per 32 inputs, the router weight in bf16, the heads under
`mtp.{last}.`, the rest as is;
config.json gains `expert_dtype: "fp4"` and the `quantization_config`. `--bundle` (implies --quantized)
writes it the way DeepSeek ships it, inside a tiny DeepSeek-V4-layout target checkpoint: the target's
own tensors (`embed.weight`, `layers.{j}.*` with FP8 experts, `norm.weight`, `head.weight`: random
filler no test may read) and the draft's `mtp.*` over three shards named by model.safetensors.index.json,
the first holding only the target's. OUT/config.json is the draft's (a target's own config does not
describe its draft's geometry).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from epdraft.config.hf import read_config_json
from epdraft.loading.quant import quantize_fp4, quantize_fp8
from epdraft.models.deepseek_dspark import DeepseekDSparkDraft
from epdraft.models.deepseek_names import to_export_state_dict
from epdraft.models.spec import DraftModelSpec

ASSETS = Path(__file__).resolve().parents[1] / "epdraft" / "assets"


def draft_config(target: dict, *, v41: bool = False) -> dict:
    """The export's config.json, the official one's keys at tiny sizes (V4.1: SpecForge's converted keys)."""
    H, V = target["hidden_size"], target["vocab_size"]
    config = {
        "architectures": ["DSparkV4DraftModel"], "model_type": "deepseek_v4_dspark_draft", "block_size": 5,
        "dflash_config": {"confidence_head_with_markov": True, "enable_confidence_head": True,
                          "kv_fake_quant": True, "markov_head_type": "vanilla", "markov_rank": 8,
                          "mask_token_id": V - 1, "projector_type": "dspark_v4", "target_layer_ids": [1, 2, 3]},
        "dtype": "float32", "hidden_size": H, "vocab_size": V, "num_hidden_layers": 3,
        "num_target_layers": target["num_hidden_layers"], "rms_norm_eps": 1e-6, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 32, "qk_rope_head_dim": 8, "q_lora_rank": 16, "o_lora_rank": 16,
        "o_groups": 2, "sliding_window": 8, "rope_theta": 10000.0, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "moe_intermediate_size": H // 2, "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    }  # fmt: skip
    if v41:
        del config["sliding_window"]
        config["dflash_config"].update(attention_mode="deepseek_v41", context_window=8)
    return config


def randomize(draft: DeepseekDSparkDraft, seed: int) -> None:
    """Norms 1, the mHC bases near SpecForge's init (pre ~ 1/hc, comb ~ identity), the rest scaled normal."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith(("norm.weight", "hc.scale", "hc_head.scale")):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


_FP8_LINEAR = re.compile(r"mtp\.\d+\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.w[123]|main_proj)\.weight")
_FP4_EXPERT = re.compile(r"mtp\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
_ROUTER = re.compile(r"mtp\.\d+\.ffn\.gate\.weight")


def release_quantization(block: int) -> dict:
    """DeepSeek's released config keys: expert_dtype and quantization_config (FP8 e4m3, e8m0 scales)."""
    return {"expert_dtype": "fp4", "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
        "weight_block_size": [block, block]}}


def quantize_release(tensors: dict[str, torch.Tensor], block: int, num_layers: int) -> dict[str, torch.Tensor]:
    """The export's tensors in DeepSeek's released storage (module docstring), `.scale` beside each quantized
    `.weight`, and its heads under the last stage (`mtp.{last}.markov_head.*`, as released; SpecForge keeps them at
    the root)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.startswith(("markov_head.", "confidence_head.")):
            name = f"mtp.{num_layers - 1}.{name}"
        if _FP8_LINEAR.fullmatch(name) or _FP4_EXPERT.fullmatch(name):
            q, scale = quantize_fp4(t) if _FP4_EXPERT.fullmatch(name) else quantize_fp8(t, (block, block), ue8m0=True)
            out[name], out[name.removesuffix(".weight") + ".scale"] = q, scale
        elif _ROUTER.fullmatch(name):
            out[name] = t.bfloat16()
        else:
            out[name] = t
    return out


def target_filler(cfg: dict, block: int, seed: int) -> dict[str, torch.Tensor]:
    """A tiny DeepSeek-V4-layout target's own tensors (2 layers, FP8 linears and experts): never to be read."""
    gen = torch.Generator().manual_seed(seed + 1)
    H, V, I, E = cfg["hidden_size"], cfg["vocab_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    out = {"embed.weight": torch.randn(V, H, generator=gen), "norm.weight": torch.ones(H),
           "head.weight": torch.randn(V, H, generator=gen)}
    shapes = {"attn.wq_a": (16, H), "ffn.shared_experts.w1": (I, H),
              **{f"ffn.experts.{e}.w{k}": (H, I) if k == 2 else (I, H) for e in range(E) for k in (1, 2, 3)}}
    for j in range(2):
        for name, shape in shapes.items():
            q, scale = quantize_fp8(torch.randn(*shape, generator=gen), (block, block), ue8m0=True)
            out[f"layers.{j}.{name}.weight"], out[f"layers.{j}.{name}.scale"] = q, scale
        out[f"layers.{j}.ffn.gate.weight"] = torch.randn(E, H, generator=gen).bfloat16()
    return out


def write_bundle(out: Path, target: dict[str, torch.Tensor], draft: dict[str, torch.Tensor]) -> None:
    """Three shards and their index: [embed + target layer 0], [target layer 1 + mtp.0], [the other mtp.* + head, norm]."""
    shards: list[dict[str, torch.Tensor]] = [{}, {}, {}]
    for name, t in {**target, **draft}.items():
        i = 0 if name == "embed.weight" or name.startswith("layers.0.") else \
            1 if name.startswith(("layers.1.", "mtp.0.")) else 2
        shards[i][name] = t
    weight_map = {}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map |= {name: file for name in tensors}
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for s in shards for t in s.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--target", type=Path, default=ASSETS / "tiny-target")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--v41", action="store_true", help="DeepSeek-V4.1's draft (no q norm, single-pass mHC)")
    p.add_argument("--quantized", action="store_true", help="DeepSeek's released storage: FP8 linears, FP4 experts")
    p.add_argument("--block", type=int, help="FP8 scale block (default 128; 32 with --v41)")
    p.add_argument("--bundle", action="store_true", help="inside a tiny DeepSeek-V4-layout target checkpoint "
                   "(sharded, with its index); implies --quantized")
    a = p.parse_args()
    cfg = draft_config(read_config_json(a.target), v41=a.v41)
    spec = DraftModelSpec.from_config(cfg)
    draft = DeepseekDSparkDraft(spec)
    randomize(draft, a.seed)
    tensors = to_export_state_dict(draft, spec.num_layers)
    block = a.block or (32 if a.v41 else 128)
    if a.quantized or a.bundle:
        cfg |= release_quantization(block)
        tensors = quantize_release(tensors, block, spec.num_layers)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if a.bundle:
        write_bundle(a.out, target_filler(cfg, block, a.seed), tensors)
    else:
        save_file(tensors, str(a.out / "model.safetensors"), metadata={"format": "pt"})
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
