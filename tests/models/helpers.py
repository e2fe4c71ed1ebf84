"""Tiny draft configs, random weights and a tiny HF target shared by the model tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from epdraft.models import DFlashDraft
from epdraft.models.checkpoint import to_specforge_state_dict

H, VOCAB, MASK = 32, 50, 49


def draft_config(*, moe: bool = True, dspark: bool = False, block_size: int = 4, layer_ids=(0, 2),
                 markov: str = "vanilla", confidence_with_markov: bool = True, mask_filling: bool | None = None,
                 layer_types: list[str] | None = None, sliding_window: int | None = None,
                 num_hash_layers: int = 0) -> dict:
    """A SpecForge-style export config.json: qwen3_5_moe-preset MoE (or dense) FFNs, optional DSpark keys,
    readout, sliding-window layers (`layer_types` sets the layer count) and hash-routed MoE layers."""
    cfg = {
        "architectures": ["DSparkDraftModel" if dspark else "DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": H, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 2,
        "intermediate_size": 48, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "vocab_size": VOCAB, "block_size": block_size, "num_target_layers": 3,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": list(layer_ids)},
    }
    if moe:
        cfg |= {
            "moe_preset": "qwen3_5_moe", "n_routed_experts": 8, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "n_shared_experts": 1,
            "scoring_func": "softmax", "norm_topk_prob": True, "routed_scaling_factor": 1.0,
        }
    if dspark:
        cfg["dflash_config"] |= {"projector_type": "dspark", "markov_rank": 6, "markov_head_type": markov,
                                 "enable_confidence_head": True,
                                 "confidence_head_with_markov": confidence_with_markov}
    if mask_filling is not None:
        cfg["dflash_config"]["mask_filling"] = mask_filling
    if layer_types is not None:
        cfg |= {"layer_types": layer_types, "num_hidden_layers": len(layer_types), "sliding_window": sliding_window}
    if num_hash_layers:
        cfg["num_hash_layers"] = num_hash_layers
    return cfg


def randomize(module: torch.nn.Module, seed: int = 0, scale: float = 0.3) -> None:
    """Deterministic random weights everywhere (norm weights near 1), so every tensor matters."""
    gen = torch.Generator().manual_seed(seed)
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("tid2eid"):  # a hash layer's token -> experts table: ids of its router's experts
                p.copy_(torch.randint(0, params[name.replace("tid2eid", "weight")].shape[0], p.shape, generator=gen))
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else scale * noise)


def write_export(draft: DFlashDraft, cfg: dict, path: Path, *, prefix: str = "", drop: tuple[str, ...] = (),
                 extra: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `draft` as a SpecForge export (config.json + model.safetensors) under `path`."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = {prefix + k: v for k, v in to_specforge_state_dict(draft).items() if k not in drop}
    tensors |= extra or {}
    save_file(tensors, str(path / "model.safetensors"))
    return path


def tiny_target(seed: int = 0):
    """A random 3-layer byte-free Qwen3 target (HFTarget) with sharpened weights (few argmax ties)."""
    import transformers

    from epdraft.target.hf import HFTarget

    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=True,
    )
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return HFTarget(model, feature_layer_ids=[0, 2])


def hf_greedy(target, prompt: list[int], n: int) -> list[int]:
    """The `n` tokens HF's own `generate` decodes greedily after `prompt`: the independent reference
    every lossless test holds speculative decoding to (no early stop at an EOS)."""
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()
