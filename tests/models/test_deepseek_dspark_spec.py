"""DraftModelSpec.from_config on SpecForge's DeepSeek-V4 / V4.1 DSpark export configs (issue 31)."""

import json
from pathlib import Path

import pytest

from epdraft.errors import ConfigError
from epdraft.models.spec import DraftModelSpec

CONFIG = json.loads((Path(__file__).parents[1] / "fixtures" / "deepseek_v4_flash_dspark_config.json").read_text())


def test_official_config_is_dspark_v4():
    spec = DraftModelSpec.from_config(CONFIG)
    assert spec.kind == "dspark_v4"
    d = spec.deepseek
    assert (d.q_lora_rank, d.rope_head_dim, d.o_groups, d.o_lora_rank, d.window) == (1024, 64, 8, 1024, 128)
    assert (d.hc_mult, d.hc_sinkhorn_iters, d.hc_eps, d.kv_fake_quant, d.q_norm) == (4, 20, 1e-6, True, True)
    assert (spec.num_kv_heads, spec.head_dim, spec.block_size, spec.num_drafts) == (1, 512, 5, 4)
    assert spec.target_layer_ids == (40, 41, 42) and spec.mask_token_id == 128799
    assert spec.markov_rank == 256 and spec.enable_confidence_head and spec.confidence_head_with_markov
    assert spec.sliding_window is None and spec.layer_types == ("full_attention",) * 3
    router = spec.ffn.layers[0].router
    assert (router.scoring, router.bias, router.top_k, router.routed_scaling_factor) == (
        "sqrtsoftplus", "selection", 6, 1.5)
    assert spec.ffn.layers[0].activation.limit == 10.0 and spec.ffn.layers[0].shared_intermediate_size == 2048


def test_architecture_alone_selects_dspark_v4():
    config = {**CONFIG, "dflash_config": {k: v for k, v in CONFIG["dflash_config"].items() if k != "projector_type"}}
    assert DraftModelSpec.from_config(config).kind == "dspark_v4"


@pytest.mark.parametrize("key, value, named", [
    ("num_key_value_heads", 2, "num_key_value_heads"),
    ("o_groups", 3, "o_groups"),
    ("qk_rope_head_dim", 7, "qk_rope_head_dim"),
    ("moe_preset", "qwen3_moe", "moe_preset"),
    ("layer_types", ["sliding_attention"] * 3, "layer_types"),
    ("attention_mode", "gqa", "attention_mode.*deepseek_v41"),
])
def test_unsupported_values_name_the_key(key, value, named):
    with pytest.raises(ConfigError, match=named):
        DraftModelSpec.from_config({**CONFIG, key: value})


def test_missing_deepseek_key_is_named():
    config = {k: v for k, v in CONFIG.items() if k != "q_lora_rank"}
    with pytest.raises(ConfigError, match="q_lora_rank"):
        DraftModelSpec.from_config(config)


def test_gated_markov_head_refused():
    config = {**CONFIG, "dflash_config": {**CONFIG["dflash_config"], "markov_head_type": "gated"}}
    with pytest.raises(ConfigError, match="markov_head_type"):
        DraftModelSpec.from_config(config)


def test_kv_fake_quant_default_follows_specforge():
    config = {**CONFIG, "dflash_config": {k: v for k, v in CONFIG["dflash_config"].items() if k != "kv_fake_quant"}}
    assert DraftModelSpec.from_config(config).deepseek.kv_fake_quant


def v41_config(**dflash) -> dict:
    """SpecForge's converted V4.1 config: attention_mode and the window under dflash_config."""
    base = {k: v for k, v in CONFIG.items() if k != "sliding_window"}
    return {**base, "dflash_config": {**CONFIG["dflash_config"], "attention_mode": "deepseek_v41",
                                      "context_window": 128, **dflash}}  # fmt: skip


def test_v41_config_selects_the_v41_variant():
    spec = DraftModelSpec.from_config(v41_config())
    d = spec.deepseek
    assert spec.kind == "dspark_v4" and d.variant == "v41" and not d.q_norm and d.single_pass
    assert d.window == 128 and "deepseek v41" in spec.deepseek.describe(spec.num_heads, spec.head_dim)


def test_attention_mode_at_top_level_and_v4_spellings():
    top = {**CONFIG, "attention_mode": "deepseek_v41"}
    assert DraftModelSpec.from_config(top).deepseek.variant == "v41"
    v4 = DraftModelSpec.from_config({**CONFIG, "attention_mode": "deepseek_v4"}).deepseek
    assert v4.variant == "v4" and v4.q_norm and not v4.single_pass
    assert DraftModelSpec.from_config(CONFIG).deepseek.variant == "v4"


def test_context_window_agreeing_with_sliding_window_is_accepted():
    config = {**v41_config(), "sliding_window": 128}
    assert DraftModelSpec.from_config(config).deepseek.window == 128


def test_context_window_contradicting_sliding_window_names_both():
    config = {**v41_config(context_window=64), "sliding_window": 128}
    with pytest.raises(ConfigError, match="context_window = 64 contradicts sliding_window = 128"):
        DraftModelSpec.from_config(config)


def test_missing_window_names_both_keys():
    config = v41_config()
    del config["dflash_config"]["context_window"]
    with pytest.raises(ConfigError, match="sliding_window.*context_window"):
        DraftModelSpec.from_config(config)


def test_attention_mode_places_that_disagree_are_refused():
    with pytest.raises(ConfigError, match="attention_mode"):
        DraftModelSpec.from_config({**v41_config(), "attention_mode": "deepseek_v4"})
