"""What each supported MoE family's config.json means: one `Family` row per family.

A row says which keys the family reads (with the default its transformers config class, or
SpecForge, uses when the key is absent) and which values its modeling code hardcodes. A config
that sets a hardcoded key to another value is refused rather than ignored: transformers would
ignore it, and serving something other than what the config says is a silent change of model.
Sources: ../shared/reference/moe_numerics.md sections 2-3 (transformers 5.24.0, SpecForge #811/#812).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from epdraft.config.ffn import RouterBias

SharedKind = Literal["none", "qwen", "deepseek", "specforge"]
"""qwen: `shared_expert_intermediate_size`, sigmoid-gated; deepseek: `moe_intermediate_size *
n_shared_experts`, ungated; specforge: `n_shared_experts` in {0, 1}, optional sigmoid gate."""


class Family(msgspec.Struct, frozen=True, kw_only=True):
    """How one family's config keys map onto the FFN specs."""

    name: str
    expert_size_keys: tuple[str, ...]
    """Keys of the per-expert intermediate size, first present wins."""
    reads: dict[str, Any]
    """Routing/activation keys the family reads -> default when absent."""
    fixed: dict[str, Any]
    """Keys whose value the family hardcodes -> that value; another value is refused."""
    bias: RouterBias | None
    """What `gate.bias` means; None: SpecForge's `topk_method`/`balance`/`moe_router_bias` decide."""
    renorm_eps: float
    """Added to the top-k sum: 1e-20 in SpecForge and DeepSeek; Qwen/Mixtral divide by the bare sum."""
    shared: SharedKind
    activation: Literal["swiglu", "swigluoai"] = "swiglu"
    expert_bias: bool = False
    hash_layers: int = 0
    """Default number of leading hash-routed layers when `num_hash_layers` is absent (DeepSeek-V4: 3)."""


_QWEN_FIXED = {"scoring_func": "softmax", "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
               "swiglu_limit": 0.0}

QWEN3_MOE = Family(
    name="qwen3_moe", expert_size_keys=("moe_intermediate_size",), reads={"norm_topk_prob": False},
    fixed=_QWEN_FIXED, bias="none", renorm_eps=0.0, shared="none",
)
QWEN2_MOE = Family(
    name="qwen2_moe", expert_size_keys=("moe_intermediate_size",), reads={"norm_topk_prob": False},
    fixed=_QWEN_FIXED, bias="none", renorm_eps=0.0, shared="qwen",
)
# Qwen3_5MoeTopKRouter always renormalises: it has no norm_topk_prob flag.
QWEN3_5_MOE = Family(
    name="qwen3_5_moe", expert_size_keys=("moe_intermediate_size",), reads={},
    fixed={**_QWEN_FIXED, "norm_topk_prob": True}, bias="none", renorm_eps=0.0, shared="qwen",
)
MIXTRAL = Family(
    name="mixtral", expert_size_keys=("intermediate_size",), reads={},
    fixed={**_QWEN_FIXED, "norm_topk_prob": True}, bias="none", renorm_eps=0.0, shared="none",
)
# DeepseekV3TopkRouter hardcodes sigmoid scores and the noaux_tc selection bias.
DEEPSEEK_V3 = Family(
    name="deepseek_v3", expert_size_keys=("moe_intermediate_size",),
    reads={"norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
           "n_shared_experts": 1},
    fixed={"scoring_func": "sigmoid", "topk_method": "noaux_tc", "swiglu_limit": 0.0},
    bias="selection", renorm_eps=1e-20, shared="deepseek",
)
# DeepSeek-V4 always renormalises; `intermediate_size` is an alias of the expert size.
DEEPSEEK_V4 = Family(
    name="deepseek_v4", expert_size_keys=("moe_intermediate_size", "intermediate_size"),
    reads={"scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
           "n_shared_experts": 1},
    fixed={"norm_topk_prob": True, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1},
    bias="selection", renorm_eps=1e-20, shared="deepseek", hash_layers=3,
)
# gpt-oss: softmax over the top-k logits only (no renorm, no scale), a router logit bias,
# expert biases and the clamped (up + 1) * gate * sigmoid(alpha * gate) activation.
GPT_OSS = Family(
    name="gpt_oss", expert_size_keys=("intermediate_size",),
    reads={"swiglu_limit": 7.0, "swiglu_alpha": 1.702},
    fixed={"scoring_func": "softmax_topk", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
           "n_group": 1, "topk_group": 1},
    bias="logit", renorm_eps=0.0, shared="none", activation="swigluoai", expert_bias=True,
)
# SpecForge MoE drafts: defaults of specforge/modeling/draft/moe/config.py; presets overlay them
# and explicit top-level keys override both.
SPECFORGE = Family(
    name="specforge", expert_size_keys=("moe_intermediate_size",),
    reads={"scoring_func": "softmax", "norm_topk_prob": True, "routed_scaling_factor": 1.0,
           "n_group": 1, "topk_group": 1, "swiglu_limit": 0.0, "n_shared_experts": 1,
           "shared_expert_gate": "none", "balance": "none"},
    fixed={"router": "topk", "shared_expert": "swiglu"},
    bias=None, renorm_eps=1e-20, shared="specforge",
)

SPECFORGE_PRESETS: dict[str, dict[str, Any]] = {
    "deepseek_v4": {"scoring_func": "sqrtsoftplus", "balance": "noaux_tc", "norm_topk_prob": True,
                    "routed_scaling_factor": 1.5, "n_shared_experts": 1, "shared_expert_gate": "none",
                    "swiglu_limit": 10.0},
    "qwen3_5_moe": {"scoring_func": "softmax", "balance": "aux_loss", "norm_topk_prob": True,
                    "routed_scaling_factor": 1.0, "n_shared_experts": 1, "shared_expert_gate": "sigmoid",
                    "swiglu_limit": 0.0},
    "qwen3": {"scoring_func": "softmax", "balance": "noaux_tc", "norm_topk_prob": True,
              "routed_scaling_factor": 1.0, "n_shared_experts": 0, "shared_expert_gate": "none",
              "swiglu_limit": 0.0},
}

BY_MODEL_TYPE: dict[str, Family] = {
    "qwen3_moe": QWEN3_MOE,
    "qwen2_moe": QWEN2_MOE,
    "qwen3_5_moe": QWEN3_5_MOE,
    "qwen3_5_moe_text": QWEN3_5_MOE,
    "mixtral": MIXTRAL,
    "deepseek_v3": DEEPSEEK_V3,
    "deepseek_v4": DEEPSEEK_V4,
    "gpt_oss": GPT_OSS,
}

BY_ARCHITECTURE: dict[str, Family] = {
    "Qwen3MoeForCausalLM": QWEN3_MOE,
    "Qwen2MoeForCausalLM": QWEN2_MOE,
    "Qwen3_5MoeForConditionalGeneration": QWEN3_5_MOE,
    "Qwen3_5MoeForCausalLM": QWEN3_5_MOE,
    "MixtralForCausalLM": MIXTRAL,
    "DeepseekV3ForCausalLM": DEEPSEEK_V3,
    "DeepseekV4ForCausalLM": DEEPSEEK_V4,
    "GptOssForCausalLM": GPT_OSS,
    # SpecForge draft classes (training and SGLang serving names).
    "DFlashDraftModel": SPECFORGE,
    "DSparkDraftModel": SPECFORGE,
    "DFlash2DraftModel": SPECFORGE,
    "DFlashMoEDraftModel": SPECFORGE,
    "DFlash2MoEDraftModel": SPECFORGE,
    "Qwen3MoeDSparkModel": SPECFORGE,
    "Qwen3MoEDSparkModel": SPECFORGE,
}
