"""Write a tiny random DeepSeek-V4 (or V4.1) DSpark draft (SpecForge `DSparkV4DraftModel` export) for a target.

    python tools/make_deepseek_dspark_draft.py OUT [--target epdraft/assets/tiny-target] [--seed 0] [--v41]

hidden = the target's, 4 heads of 32, rope 8, q_lora 16, 2 output groups of rank 16, 8 experts top-2
(sqrtsoftplus, one shared expert), hc_mult 4, window 8, block 5, target_layer_ids [1, 2, 3], vanilla
Markov head of rank 8 and the confidence head. `--v41` writes DeepSeek-V4.1's variant
(`attention_mode: "deepseek_v41"`, the window as `dflash_config.context_window`: no q norm, single-pass
mHC, no `hc_head_*` tensors), laid out from the architecture description (reference draft_models.md 6b),
not from a released V4.1 export. Random weights: about no draft is accepted, decoding
stays lossless. Writes OUT/config.json and OUT/model.safetensors in the export's `mtp.*` names.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from epdraft.config.hf import read_config_json
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--target", type=Path, default=ASSETS / "tiny-target")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--v41", action="store_true", help="DeepSeek-V4.1's draft (no q norm, single-pass mHC)")
    a = p.parse_args()
    cfg = draft_config(read_config_json(a.target), v41=a.v41)
    spec = DraftModelSpec.from_config(cfg)
    draft = DeepseekDSparkDraft(spec)
    randomize(draft, a.seed)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(to_export_state_dict(draft, spec.num_layers), str(a.out / "model.safetensors"), metadata={"format": "pt"})
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
