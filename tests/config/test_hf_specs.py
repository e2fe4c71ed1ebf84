"""HF / SpecForge config.json -> DraftMixFFNSpec, for every fixture and every family rule.

Expected values are typed in from the public configs and the family math (moe_numerics.md), and
the layer schedules and expert geometry are cross-checked against transformers' own config classes.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from epdraft.config import DraftDenseFFNSpec, DraftMixFFNSpec, DraftMoeFFNSpec
from epdraft.config.hf import parse_ffn_config, read_config_json
from epdraft.errors import ConfigError

FIXTURES = Path(__file__).parent.parent / "fixtures" / "configs"

# name: (family, layers, dense layer ids, E, k, I, scoring, renorm, eps, rsf, groups, bias, shared, gated,
#        activation, clamp, expert biases)
EXPECTED = {
    "qwen3-30b-a3b": ("qwen3_moe", 48, (), 128, 8, 768, "softmax", True, 0.0, 1.0, (1, 1), "none", 0, False,
                      "swiglu", 0.0, False),
    "qwen2-57b-a14b": ("qwen2_moe", 28, (), 64, 8, 2560, "softmax", False, 0.0, 1.0, (1, 1), "none", 20480, True,
                       "swiglu", 0.0, False),
    "qwen3.5-35b-a3b": ("qwen3_5_moe", 40, (), 256, 8, 512, "softmax", True, 0.0, 1.0, (1, 1), "none", 512, True,
                        "swiglu", 0.0, False),
    "mixtral-8x7b": ("mixtral", 32, (), 8, 2, 14336, "softmax", True, 0.0, 1.0, (1, 1), "none", 0, False,
                     "swiglu", 0.0, False),
    "deepseek-v3": ("deepseek_v3", 61, (0, 1, 2), 256, 8, 2048, "sigmoid", True, 1e-20, 2.5, (8, 4), "selection",
                    2048, False, "swiglu", 0.0, False),
    "deepseek-v4-flash": ("deepseek_v4", 43, (), 256, 6, 2048, "sqrtsoftplus", True, 1e-20, 1.5, (1, 1),
                          "selection", 2048, False, "swiglu", 10.0, False),
    "gpt-oss-120b": ("gpt_oss", 36, (), 128, 4, 2880, "softmax_topk", False, 0.0, 1.0, (1, 1), "logit", 0, False,
                     "swigluoai", 7.0, True),
    "gpt-oss-20b": ("gpt_oss", 24, (), 32, 4, 2880, "softmax_topk", False, 0.0, 1.0, (1, 1), "logit", 0, False,
                    "swigluoai", 7.0, True),
    "qwen3.8-27b-dspark-moe": ("specforge/qwen3_5_moe", 5, (), 512, 10, 512, "softmax", True, 1e-20, 1.0, (1, 1),
                               "none", 2048, True, "swiglu", 0.0, False),
    "qwen3.8-27b-dspark-moe-v2": ("specforge/qwen3_5_moe", 5, (), 512, 10, 512, "softmax", True, 1e-20, 1.0,
                                  (1, 1), "logit", 2048, True, "swiglu", 0.0, False),
    "qwen3.8-27b-dspark-moe-16x1024": ("specforge/qwen3_5_moe", 5, (), 16, 2, 1024, "softmax", True, 1e-20, 1.0,
                                       (1, 1), "logit", 2048, True, "swiglu", 0.0, False),
    "qwen3.8-27b-dspark-moe-exp-d-noaux": ("specforge/qwen3_5_moe", 5, (), 512, 10, 512, "softmax", True, 1e-20,
                                           1.0, (1, 1), "selection", 2048, True, "swiglu", 0.0, False),
    "deepseek-v4-flash-dspark-moe": ("specforge/deepseek_v4", 5, (), 64, 6, 2048, "sqrtsoftplus", True, 1e-20, 1.5,
                                     (1, 1), "selection", 2048, False, "swiglu", 10.0, False),
    "deepseek-v4-flash-dspark-moe-pr799": ("specforge", 5, (), 64, 6, 2048, "sqrtsoftplus", True, 1e-20, 1.5,
                                           (1, 1), "none", 2048, False, "swiglu", 10.0, False),
}


def load(name: str) -> dict:
    return read_config_json(FIXTURES / f"{name}.json")


def parse(config: dict) -> DraftMixFFNSpec:
    return DraftMixFFNSpec.from_config(config)


def refused(config: dict, *needles: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse(config)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    return message


def test_every_fixture_has_expectations():
    assert sorted(p.stem for p in FIXTURES.glob("*.json")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_parses_to_expected_layers(name):
    (family, num_layers, dense, E, k, I, scoring, renorm, eps, rsf, groups, bias, shared, gated, act, clamp,
     expert_bias) = EXPECTED[name]
    spec = parse(load(name))
    assert spec.family == family
    assert spec.num_layers == num_layers
    assert spec.moe_layers == tuple(i for i in range(num_layers) if i not in dense)
    topk = [i for i in spec.moe_layers if not spec.layers[i].router.hash_routed]  # hash layers: test_hash_layers_parsed
    moe = spec.layers[topk[0]]
    assert all(spec.layers[i] == moe for i in topk)
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (E, k, I)
    r = moe.router
    assert (r.scoring, r.norm_topk_prob, r.renorm_eps, r.routed_scaling_factor) == (scoring, renorm, eps, rsf)
    assert (r.n_group, r.topk_group, r.bias) == (*groups, bias)
    assert (moe.shared_intermediate_size, moe.shared_gate) == (shared, gated)
    assert (moe.activation.kind, moe.activation.limit, moe.expert_bias) == (act, clamp, expert_bias)


def test_deepseek_v3_dense_prefix_and_groups():
    spec = parse(load("deepseek-v3"))
    assert all(spec.layers[i] == DraftDenseFFNSpec(intermediate_size=18432) for i in range(3))
    moe = spec.layers[3]
    assert isinstance(moe, DraftMoeFFNSpec) and moe.router.group_limited
    assert moe.expert_bytes(spec.hidden_size) == 256 * 3 * 2048 * 7168 * 2


def test_deepseek_v3_shared_width_scales_with_n_shared():
    config = load("deepseek-v3") | {"n_shared_experts": 2}
    assert parse(config).layers[3].shared_intermediate_size == 2 * 2048


def test_deepseek_v3_hardcoded_sigmoid_noaux_tc():
    refused(load("deepseek-v3") | {"scoring_func": "softmax"}, "scoring_func = 'softmax'", "sigmoid")
    refused(load("deepseek-v3") | {"topk_method": "greedy"}, "topk_method = 'greedy'")


def test_gpt_oss_alpha_and_limit_keys():
    moe = parse(load("gpt-oss-20b") | {"swiglu_alpha": 1.5, "swiglu_limit": 5.0}).layers[0]
    assert (moe.activation.kind, moe.activation.alpha, moe.activation.limit) == ("swigluoai", 1.5, 5.0)


def test_qwen35_always_renormalises():
    config = load("qwen3.5-35b-a3b")
    del config["text_config"]["norm_topk_prob"]
    assert parse(config).layers[0].router.norm_topk_prob
    config["text_config"]["norm_topk_prob"] = False
    refused(config, "text_config.norm_topk_prob = False", "always")


def test_qwen_flag_renorm_defaults_off_like_transformers():
    config = load("qwen3-30b-a3b")
    del config["norm_topk_prob"]
    assert not parse(config).layers[0].router.norm_topk_prob


def test_specforge_preset_defaults_overridden_by_top_level_keys():
    config = load("qwen3.8-27b-dspark-moe") | {"shared_expert_gate": "none", "routed_scaling_factor": 2.0}
    moe = parse(config).layers[0]
    assert (moe.shared_gate, moe.router.routed_scaling_factor) == (False, 2.0)
    moe = parse(load("deepseek-v4-flash-dspark-moe") | {"swiglu_limit": 0.0, "scoring_func": "sigmoid"}).layers[0]
    assert (moe.activation.limit, moe.router.scoring, moe.router.bias) == (0.0, "sigmoid", "selection")
    moe = parse(load("deepseek-v4-flash-dspark-moe") | {"balance": "aux_loss"}).layers[0]
    assert moe.router.bias == "none"


def test_specforge_qwen3_preset_has_no_shared_expert_and_selection_bias():
    config = load("qwen3.8-27b-dspark-moe") | {"moe_preset": "qwen3"}
    del config["shared_expert_intermediate_size"], config["n_shared_experts"]
    moe = parse(config).layers[0]
    assert (moe.shared_intermediate_size, moe.router.bias) == (0, "selection")


def test_specforge_logit_bias_follows_export_normalizer():
    v2 = load("qwen3.8-27b-dspark-moe-v2")
    assert parse(v2).layers[0].router.bias == "logit"
    assert parse(v2 | {"moe_router_bias": False}).layers[0].router.bias == "none"
    refused(v2 | {"topk_method": "noaux_tc"}, "moe_router_bias", "noaux_tc")


def test_specforge_shared_size_defaults_to_expert_size():
    config = load("qwen3.8-27b-dspark-moe")
    del config["shared_expert_intermediate_size"]
    assert parse(config).layers[0].shared_intermediate_size == 512


def test_no_expert_fields_is_all_dense():
    config = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3}
    spec = parse(config)
    assert spec.layers == (DraftDenseFFNSpec(intermediate_size=96),) * 3 and spec.moe_layers == ()


def test_qwen_sparse_step_and_mlp_only_layers():
    config = load("qwen3-30b-a3b") | {"num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    spec = parse(config)
    assert spec.moe_layers == (1, 5)
    assert spec.layers[0] == DraftDenseFFNSpec(intermediate_size=6144)


def test_moe_layer_freq():
    config = load("deepseek-v3") | {"num_hidden_layers": 8, "first_k_dense_replace": 1, "moe_layer_freq": 2}
    assert parse(config).moe_layers == (2, 4, 6)


def test_ffn_layer_types():
    config = load("qwen3.8-27b-dspark-moe") | {"ffn_layer_types": ["dense", "moe", "moe", "dense", "moe"]}
    spec = parse(config)
    assert spec.moe_layers == (1, 2, 4)
    assert spec.layers[0] == DraftDenseFFNSpec(intermediate_size=17408)


def _kinds(spec: DraftMixFFNSpec) -> list[str]:
    return ["dense" if not isinstance(l, DraftMoeFFNSpec) else "hash_moe" if l.router.hash_routed else "moe"
            for l in spec.layers]


def test_hash_layers_parsed():
    config = load("deepseek-v4-flash")
    spec = parse(config | {"num_hash_layers": 3})
    assert _kinds(spec) == ["hash_moe"] * 3 + ["moe"] * 40
    hashed, plain = spec.layers[0].router, spec.layers[3].router
    # tid2eid picks the experts: no selection bias; the weights keep the top-k layer's scoring and scaling.
    assert (hashed.bias, plain.bias, hashed.vocab_size) == ("none", "selection", 129280)
    assert (hashed.scoring, hashed.norm_topk_prob, hashed.routed_scaling_factor) == ("sqrtsoftplus", True, 1.5)
    del config["num_hash_layers"]
    assert _kinds(parse(config))[:4] == ["hash_moe"] * 3 + ["moe"]  # transformers' default: 3 hash layers
    types = ["hash_moe"] * 2 + ["moe"] * 41
    assert _kinds(parse(config | {"mlp_layer_types": types})) == types


def test_malformed_hash_layers_refused():
    config = load("deepseek-v4-flash")
    refused(config | {"num_hash_layers": 44}, "num_hash_layers = 44", "num_hidden_layers = 43")
    refused(config | {"num_hash_layers": 2, "first_k_dense_replace": 1}, "layers [0] are dense")
    refused(config | {"num_hash_layers": -1}, "num_hash_layers = -1")
    refused(config | {"mlp_layer_types": ["hash"] + ["moe"] * 42}, "mlp_layer_types[0] = 'hash'")
    types = ["hash_moe"] * 2 + ["moe"] * 41
    refused(config | {"mlp_layer_types": types, "num_hash_layers": 3}, "num_hash_layers = 3", "2 'hash_moe'")
    no_vocab = {k: v for k, v in config.items() if k != "vocab_size"} | {"num_hash_layers": 1}
    refused(no_vocab, "vocab_size is missing")


@pytest.mark.parametrize(
    "change, needles",
    [
        ({"n_group": 3}, ("n_group = 3 must divide n_routed_experts = 256",)),
        ({"topk_group": 9}, ("topk_group = 9", "n_group = 8")),
        ({"num_experts_per_tok": 300}, ("num_experts_per_tok = 300", "n_routed_experts = 256")),
        ({"num_experts_per_tok": 8, "topk_group": 1, "n_group": 128}, ("num_experts_per_tok = 8 exceeds",)),
        ({"moe_intermediate_size": 0}, ("moe_intermediate_size = 0",)),
        ({"hidden_size": -1}, ("hidden_size = -1",)),
        ({"hidden_act": "gelu"}, ("hidden_act = 'gelu'",)),
        ({"num_local_experts": 128}, ("num_local_experts = 128 contradicts n_routed_experts = 256",)),
        ({"quantization_config": {"quant_method": "fp8"}}, ("quantization_config.weight_block_size is missing",)),
        ({"quantization_config": {"quant_method": "gptq"}}, ("quantization_config.quant_method = 'gptq'",)),
        ({"routed_scaling_factor": "2.5"}, ("routed_scaling_factor = '2.5'",)),
        ({"first_k_dense_replace": -1}, ("first_k_dense_replace = -1",)),
        ({"mlp_only_layers": [70]}, ("mlp_only_layers has 70",)),
    ],
)
def test_deepseek_v3_malformed(change, needles):
    refused(load("deepseek-v3") | change, *needles)


@pytest.mark.parametrize(
    "change, needles",
    [
        ({"scoring_func": "relu"}, ("scoring_func = 'relu'",)),
        ({"n_shared_experts": 2}, ("n_shared_experts = 2", "0 or 1")),
        ({"moe_preset": "llama"}, ("moe_preset = 'llama'",)),
        ({"shared_expert_gate": "tanh"}, ("shared_expert_gate = 'tanh'",)),
        ({"balance": "noaux_tc", "topk_method": "greedy"}, ("balance = 'noaux_tc' contradicts",)),
        ({"ffn_layer_types": ["moe"] * 4}, ("ffn_layer_types has 4 entries",)),
        ({"ffn_layer_types": ["moe"] * 4 + ["mlp"]}, ("ffn_layer_types[4] = 'mlp'",)),
        ({"expert_dtype": "fp4"}, ("expert_dtype = 'fp4'",)),
        ({"num_experts_per_tok": None}, ("num_experts_per_tok is missing",)),
    ],
)
def test_specforge_malformed(change, needles):
    refused(load("qwen3.8-27b-dspark-moe") | change, *needles)


def test_unknown_family_with_experts_refused():
    refused({"model_type": "llama4", "hidden_size": 8, "num_hidden_layers": 1, "num_local_experts": 4},
            "model_type = 'llama4'", "not a supported MoE family")


def test_text_config_key_paths_and_quantization():
    config = load("qwen3.5-35b-a3b")
    bad = copy.deepcopy(config)
    bad["text_config"]["num_experts_per_tok"] = 512
    refused(bad, "text_config.num_experts_per_tok = 512", "text_config.num_experts = 256")
    refused(config | {"quantization_config": {"quant_method": "fp8"}}, "quantization_config", "fp8")
    spec = parse_ffn_config(config | {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    assert spec.quantization is not None and spec.quantization.block == (128, 128)
    nested = copy.deepcopy(config)
    nested["text_config"]["quantization_config"] = {"quant_method": "awq"}
    refused(nested, "text_config.quantization_config.quant_method = 'awq'")


def test_read_config_json_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json: cannot read"):
        read_config_json(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text("{\"hidden_size\": 8,}")
    with pytest.raises(ConfigError, match="bad.json: invalid JSON"):
        read_config_json(bad)
    bad.write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="bad.json: expected a JSON object"):
        read_config_json(bad)


HF_FIXTURES = [n for n, e in EXPECTED.items() if not e[0].startswith("specforge")]


@pytest.mark.parametrize("name", HF_FIXTURES)
def test_matches_transformers_config_classes(name):
    """transformers' own config class and layer rules give the same schedule and geometry."""
    transformers = pytest.importorskip("transformers")
    config = load(name)
    hf = transformers.AutoConfig.for_model(**config)
    hf = getattr(hf, "text_config", None) or hf
    n = hf.num_hidden_layers
    if hasattr(hf, "mlp_only_layers"):  # Qwen2/3-MoE decoder layer rule
        moe = [i not in hf.mlp_only_layers and (i + 1) % hf.decoder_sparse_step == 0 for i in range(n)]
    elif hasattr(hf, "first_k_dense_replace"):
        moe = [i >= hf.first_k_dense_replace for i in range(n)]
    elif hasattr(hf, "mlp_layer_types"):
        moe = [t in ("moe", "hash_moe") for t in hf.mlp_layer_types]
    else:
        moe = [True] * n
    spec = parse(config)
    assert spec.moe_layers == tuple(i for i in range(n) if moe[i])
    layer = spec.layers[spec.moe_layers[0]]
    num_experts = getattr(hf, "num_experts", None) or getattr(hf, "n_routed_experts", None) or hf.num_local_experts
    size = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
    assert (layer.num_experts, layer.top_k, layer.intermediate_size) == (num_experts, hf.num_experts_per_tok, size)
    assert spec.hidden_size == hf.hidden_size


def test_transformers_deepseek_v4_default_hash_layers_match_ours():
    transformers = pytest.importorskip("transformers")
    config = load("deepseek-v4-flash")
    for change in ({"num_hash_layers": 5}, {"num_hash_layers": 0}):
        hf = transformers.AutoConfig.for_model(**(config | change))
        assert _kinds(parse(config | change)) == list(hf.mlp_layer_types)
    del config["num_hash_layers"]
    assert _kinds(parse(config)) == list(transformers.AutoConfig.for_model(**config).mlp_layer_types)


def test_quantization_reaches_the_layers_whose_experts_are_converted():
    from epdraft.config.quant import QuantSpec

    config = load("deepseek-v3") | {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                            "modules_to_not_convert": ["model.layers.3.mlp.experts"]}}
    spec = parse_ffn_config(config)
    fp8 = QuantSpec(method="fp8", block=(128, 128), not_converted=("model.layers.3.mlp.experts",))
    assert spec.quantization == fp8
    assert spec.layers[3].quantization is None  # listed: its experts are stored unquantized
    assert all(spec.layers[i].quantization == fp8 for i in spec.moe_layers if i != 3)
    assert not hasattr(spec.layers[0], "quantization")  # dense layers carry no expert storage


def test_deepseek_v4_flash_released_quantization():
    """The released config: fp8 linears with e8m0 scales per 128 x 128, fp4 experts held as mxfp4, 3 hash layers."""
    from epdraft.config.quant import QuantSpec

    spec = parse(load("deepseek-v4-flash"))
    assert spec.quantization == QuantSpec(method="fp8", block=(128, 128), scale_fmt="ue8m0", expert_dtype="fp4")
    assert spec.quantization.experts == QuantSpec(method="mxfp4", block=(1, 32))
    assert spec.quantization.experts.bits_per_weight == 4.25 and spec.quantization.bits_per_weight == 8 + 8 / 128**2
    assert _kinds(spec) == ["hash_moe"] * 3 + ["moe"] * 40
    assert all(layer.quantization == spec.quantization for layer in spec.layers)
    v41 = load("deepseek-v4-flash") | {"quantization_config": {**load("deepseek-v4-flash")["quantization_config"],
                                                               "weight_block_size": [32, 32]}}
    assert parse(v41).quantization.block == (32, 32)
    # transformers' own key inside quantization_config agrees with the top-level one
    inner = load("deepseek-v4-flash")
    inner["quantization_config"]["expert_dtype"] = "fp4"
    assert parse(inner).quantization.expert_dtype == "fp4"


@pytest.mark.parametrize(
    "change, needles",
    [
        ({"fmt": "e5m2"}, ("quantization_config.fmt = 'e5m2'",)),
        ({"scale_fmt": "e4m3"}, ("quantization_config.scale_fmt = 'e4m3'",)),
        ({"activation_scheme": "static"}, ("quantization_config.activation_scheme = 'static'",)),
        ({"weight_block_size": [128]}, ("quantization_config.weight_block_size = [128]",)),
        ({"weight_block_size": [0, 128]}, ("quantization_config.weight_block_size = [0, 128]",)),
        ({"expert_dtype": "fp8"}, ("expert_dtype = 'fp4' contradicts quantization_config.expert_dtype = 'fp8'",)),
        ({"quant_method": "mxfp4"}, ("expert_dtype = 'fp4' with quantization_config.quant_method = 'mxfp4'",)),
    ],
)
def test_deepseek_v4_released_quantization_refusals_name_the_key(change, needles):
    config = load("deepseek-v4-flash")
    config["quantization_config"] = {**config["quantization_config"], **change}
    if change.get("quant_method") == "mxfp4":
        config["quantization_config"] = {"quant_method": "mxfp4"}
    refused(config, *needles)


def test_deepseek_v4_fp4_experts_need_whole_scale_groups():
    refused(load("deepseek-v4-flash") | {"expert_dtype": "int4"}, "expert_dtype = 'int4'")
    refused(load("deepseek-v4-flash") | {"moe_intermediate_size": 2040}, "moe_intermediate_size = 2040",
            "multiple of 32")
    refused(load("deepseek-v4-flash") | {"hidden_size": 4100}, "hidden_size = 4100", "multiple of 32")
    no_quant = {k: v for k, v in load("deepseek-v4-flash").items() if k != "quantization_config"}
    refused(no_quant, "expert_dtype = 'fp4'", "need a quantization_config")
