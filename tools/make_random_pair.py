"""Write a random-weight target/draft pair of realistic size, for timing runs (not for acceptance).

    python tools/make_random_pair.py OUT [--hidden 4096] [--experts 8] [--moe-intermediate 1536] [--top-k 2]
                                         [--draft-layers 5] [--target-layers 4] [--vocab 32000] [--dtype bfloat16]

The target is an HF Qwen3 causal LM (a few layers: it only has to verify), the draft a DFlash MoE in
SpecForge's export form (qwen3_5_moe preset, gated shared expert). Random weights mean almost no
draft is accepted; greedy decoding stays lossless, and the step's time split is what a draft of
this size costs. Writes OUT/target, OUT/draft and OUT/prompts.jsonl.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from epdraft.models import DFlashDraft, DraftModelSpec
from epdraft.models.checkpoint import to_specforge_state_dict


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--moe-intermediate", type=int, default=1536)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--draft-layers", type=int, default=5)
    p.add_argument("--target-layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    a = p.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, a.dtype)
    H, heads = a.hidden, a.hidden // 128
    tcfg = Qwen3Config(
        vocab_size=a.vocab, hidden_size=H, intermediate_size=4 * H, num_hidden_layers=a.target_layers,
        num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1), head_dim=128, tie_word_embeddings=True,
    )
    target = Qwen3ForCausalLM(tcfg).to(dtype)
    target.save_pretrained(a.out / "target", safe_serialization=True)
    feature_layers = sorted({1, a.target_layers // 2, a.target_layers - 2})
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
        "num_attention_heads": heads, "num_key_value_heads": max(heads // 4, 1), "head_dim": 128,
        "num_hidden_layers": a.draft_layers, "intermediate_size": 4 * H, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "vocab_size": a.vocab, "num_target_layers": a.target_layers,
        "block_size": a.block_size, "moe_preset": "qwen3_5_moe", "n_routed_experts": a.experts,
        "num_experts_per_tok": a.top_k, "moe_intermediate_size": a.moe_intermediate,
        "shared_expert_intermediate_size": a.moe_intermediate, "n_shared_experts": 1,
        "dflash_config": {"block_size": a.block_size, "mask_token_id": a.vocab - 1, "target_layer_ids": feature_layers},
    }  # fmt: skip
    draft = DFlashDraft(DraftModelSpec.from_config(cfg), dtype=dtype)
    with torch.no_grad():
        for name, t in draft.named_parameters():
            t.fill_(1.0) if name.endswith("norm.weight") else t.normal_(0.0, t.shape[-1] ** -0.5)
    (a.out / "draft").mkdir(parents=True, exist_ok=True)
    (a.out / "draft" / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(to_specforge_state_dict(draft), str(a.out / "draft" / "model.safetensors"), metadata={"format": "pt"})
    gen = torch.Generator().manual_seed(1)
    with open(a.out / "prompts.jsonl", "w") as f:
        for _ in range(a.prompts):
            f.write(json.dumps({"input_ids": torch.randint(0, a.vocab - 1, (64,), generator=gen).tolist()}) + "\n")
    print(f"wrote {a.out}/target, {a.out}/draft, {a.out}/prompts.jsonl")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
