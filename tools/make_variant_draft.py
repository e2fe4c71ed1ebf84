"""Write a tiny random draft of any SpecForge variant for a target, to run it end to end (not for acceptance).

    python tools/make_variant_draft.py OUT [--target epdraft/assets/tiny-target] [--markov gated|rnn|vanilla]
        [--autoregressive] [--no-confidence-markov] [--sliding-window W] [--hash-layers N] [--sliding-target W]

The draft is a 3-layer MoE DFlash (qwen3_5_moe preset, 8 experts, top-2), a DSpark with `--markov`;
`--sliding-window W` makes layers 0 and 2 `sliding_attention`; `--hash-layers N` routes the first N
layers by a random `tid2eid`; `--autoregressive` sets `mask_filling: false` (B drafts per step).
`--sliding-target W` also writes OUT/target: the target's weights under a config whose layers 0 and
2 slide over W positions. Random weights: about no draft is accepted, and decoding stays lossless.
Writes OUT/draft (and OUT/target).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from epdraft.config.hf import read_config_json
from epdraft.models import DFlashDraft, DraftModelSpec, DSparkDraft
from epdraft.models.checkpoint import to_specforge_state_dict

ASSETS = Path(__file__).resolve().parents[1] / "epdraft" / "assets"
SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]


def draft_config(target: dict, a: argparse.Namespace) -> dict:
    """The draft's config.json in SpecForge's export form, sized to the target."""
    H, V = target["hidden_size"], target["vocab_size"]
    n = target["num_hidden_layers"]
    cfg = {
        "architectures": ["DSparkDraftModel" if a.markov else "DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": H, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": H // 4,
        "num_hidden_layers": 3, "intermediate_size": 2 * H, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "vocab_size": V, "num_target_layers": n, "block_size": a.block_size,
        "moe_preset": "qwen3_5_moe", "n_routed_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": H // 2, "shared_expert_intermediate_size": H, "n_shared_experts": 1,
        "dflash_config": {"mask_token_id": V - 1, "target_layer_ids": sorted({1, n // 2})},
    }  # fmt: skip
    if a.markov:
        cfg["dflash_config"] |= {"projector_type": "dspark", "markov_rank": 16, "markov_head_type": a.markov,
                                 "enable_confidence_head": True,
                                 "confidence_head_with_markov": not a.no_confidence_markov}
    if a.autoregressive:
        cfg["dflash_config"]["mask_filling"] = False
    if a.sliding_window:
        cfg |= {"layer_types": SLIDING, "sliding_window": a.sliding_window}
    if a.hash_layers:
        cfg["num_hash_layers"] = a.hash_layers
    return cfg


def randomize(draft: DFlashDraft, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    params = dict(draft.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if name.endswith("tid2eid"):  # each token id: distinct experts of its layer
                E = params[name.replace("tid2eid", "weight")].shape[0]
                p.copy_(torch.stack([torch.randperm(E, generator=gen)[: p.shape[1]] for _ in range(p.shape[0])]))
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--target", type=Path, default=ASSETS / "tiny-target")
    p.add_argument("--markov", choices=("vanilla", "gated", "rnn"), help="DSpark Markov head (default: DFlash)")
    p.add_argument("--autoregressive", action="store_true", help="autoregressive readout (mask_filling: false)")
    p.add_argument("--no-confidence-markov", action="store_true", help="confidence head without Markov input")
    p.add_argument("--sliding-window", type=int, default=0, help="window of layers 0 and 2 (0: all full)")
    p.add_argument("--hash-layers", type=int, default=0, help="leading hash-routed MoE layers")
    p.add_argument("--sliding-target", type=int, default=0, help="also write OUT/target with sliding layers 0 and 2")
    p.add_argument("--block-size", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    target = read_config_json(a.target)
    cfg = draft_config(target, a)
    spec = DraftModelSpec.from_config(cfg)
    draft = (DSparkDraft if spec.kind == "dspark" else DFlashDraft)(spec)
    randomize(draft, a.seed)
    (a.out / "draft").mkdir(parents=True, exist_ok=True)
    (a.out / "draft" / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(to_specforge_state_dict(draft), str(a.out / "draft" / "model.safetensors"), metadata={"format": "pt"})
    print(f"wrote {a.out / 'draft'}")
    if a.sliding_target:
        shutil.copytree(a.target, a.out / "target", dirs_exist_ok=True)
        types = ["sliding_attention" if i in (0, 2) else "full_attention" for i in range(target["num_hidden_layers"])]
        target |= {"layer_types": types, "sliding_window": a.sliding_target, "use_sliding_window": True}
        (a.out / "target" / "config.json").write_text(json.dumps(target, indent=2) + "\n")
        print(f"wrote {a.out / 'target'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
