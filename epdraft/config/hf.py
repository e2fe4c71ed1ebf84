"""HF / SpecForge config.json -> `DraftMixFFNSpec`: one FFN spec per decoder layer.

Every value is type-checked and cross-checked here, once: what the runtime cannot run (unknown
weight quantizations, impossible groupings, a hash-routed layer that is not MoE) is refused with a `ConfigError` naming the key and
its value, so nothing downstream meets a bad spec in the middle of a collective. What each family
reads and hardcodes is the table in `epdraft.config.hf_families`.

`DraftMixFFNSpec` is defined here, beside its parser, so that `DraftMixFFNSpec.from_config` calls
down into this module's parser instead of `epdraft.config.ffn` importing this module back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec

from epdraft.config.ffn import (
    ActivationSpec,
    DraftDenseFFNSpec,
    DraftMoeFFNSpec,
    FFNSpec,
    RouterBias,
    RouterSpec,
)
from epdraft.config.quant import QuantSpec, parse_quantization_config
from epdraft.config.hf_families import BY_ARCHITECTURE, BY_MODEL_TYPE, SPECFORGE, SPECFORGE_PRESETS, Family
from epdraft.errors import ConfigError

PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0.0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]

_KNOB_TYPES: dict[str, Any] = {
    "scoring_func": str, "norm_topk_prob": bool, "routed_scaling_factor": PosFloat, "n_group": PosInt,
    "topk_group": PosInt, "swiglu_limit": NonNegFloat, "swiglu_alpha": PosFloat, "n_shared_experts": NonNegInt,
    "shared_expert_gate": str, "balance": str, "topk_method": str, "router": str, "shared_expert": str,
}
_SCORING = ("softmax", "sigmoid", "sqrtsoftplus")
_EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token")
_LAYER_TYPE_KEYS = ("ffn_layer_types", "mlp_layer_types")
_MISSING = object()


class DraftMixFFNSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One FFN spec per decoder layer, read from an HF / SpecForge config.json.

    `quantization`: how the checkpoint stores its weights (`quantization_config`); None = unquantized.
    """

    family: str
    hidden_size: Annotated[int, msgspec.Meta(ge=1)]
    layers: tuple[FFNSpec, ...]
    quantization: QuantSpec | None = None

    @classmethod
    def from_config(cls, config: dict) -> "DraftMixFFNSpec":
        """Parse an HF/SpecForge config dict; raises ConfigError naming the key and value."""
        return parse_ffn_config(config)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.layers) if isinstance(s, DraftMoeFFNSpec))


class _View:
    """Typed access to one config dict; errors carry the key path (`text_config.num_experts`)."""

    def __init__(self, data: dict, prefix: str = "") -> None:
        self.data, self.prefix = data, prefix

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def path(self, key: str) -> str:
        return self.prefix + key

    def get(self, key: str, typ: Any, default: Any = _MISSING) -> Any:
        if not self.has(key):
            if default is _MISSING:
                raise ConfigError(f"{self.path(key)} is missing")
            return default
        try:
            return msgspec.convert(self.data[key], typ)
        except msgspec.ValidationError as e:
            raise ConfigError(f"{self.path(key)} = {self.data[key]!r}: {e}") from None

    def first(self, keys: tuple[str, ...], typ: Any) -> tuple[str, Any] | None:
        """(key, value) of the first present key; aliases that disagree are refused."""
        found = [(k, self.get(k, typ)) for k in keys if self.has(k)]
        for k, value in found[1:]:
            if value != found[0][1]:
                raise ConfigError(f"{self.path(k)} = {value} contradicts {self.path(found[0][0])} = {found[0][1]}")
        return found[0] if found else None


def read_config_json(path: str | Path) -> dict:
    """The config dict of a draft directory (`DIR/config.json`) or of a JSON file; ConfigError naming the file."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        config = msgspec.json.decode(file.read_bytes())
    except OSError as e:
        raise ConfigError(f"{file}: cannot read: {e.strerror or e}") from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"{file}: invalid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{file}: expected a JSON object, got {type(config).__name__}")
    return config


def parse_ffn_config(config: dict) -> DraftMixFFNSpec:
    """One FFN spec per decoder layer from an HF / SpecForge config dict.

    Raises:
        ConfigError: naming the key and value the runtime cannot run.
    """
    if not isinstance(config, dict):
        raise ConfigError(f"config: expected a dict, got {type(config).__name__}")
    view = _View(config)
    quantization = _quantization(view)
    if isinstance(config.get("text_config"), dict) and not view.has("hidden_size"):
        view = _View(config["text_config"], "text_config.")  # Qwen3.5-MoE nests its LM under text_config
        quantization = quantization or _quantization(view)
    hidden_size = view.get("hidden_size", PosInt)
    num_layers = view.get("num_hidden_layers", PosInt)
    count = view.first(_EXPERT_COUNT_KEYS, NonNegInt)
    if count is None or count[1] == 0:
        dense = _dense_spec(view)
        return DraftMixFFNSpec(family=str(config.get("model_type", "dense")), hidden_size=hidden_size,
                               layers=(dense,) * num_layers, quantization=quantization)
    family = _detect_family(config)
    moe = _moe_spec(view, family, count)
    kinds = _moe_schedule(view, family, num_layers)
    by_kind: dict[str, FFNSpec] = {"moe": moe}
    if "dense" in kinds:
        by_kind["dense"] = _dense_spec(view)
    if "hash_moe" in kinds:
        by_kind["hash_moe"] = _hash_spec(view, moe)
    layers: tuple[FFNSpec, ...] = tuple(
        by_kind[k] if k == "dense" else _quantized_experts(by_kind[k], quantization, i, view, hidden_size)
        for i, k in enumerate(kinds)
    )
    name = family.name
    if family is SPECFORGE and view.has("moe_preset"):
        name = f"specforge/{view.get('moe_preset', str)}"
    return DraftMixFFNSpec(family=name, hidden_size=hidden_size, layers=layers, quantization=quantization)


def _quantization(view: _View) -> QuantSpec | None:
    """The weights' quantization (`quantization_config`, with DeepSeek-V4's top-level `expert_dtype`),
    None if unquantized; an `expert_dtype` that names a quantized format needs a quantization_config."""
    expert_dtype = view.data.get("expert_dtype")
    if expert_dtype in ("bf16", "bfloat16", "fp32", "float32"):
        expert_dtype = None
    if not view.has("quantization_config"):
        if expert_dtype is not None:
            raise ConfigError(f"{view.path('expert_dtype')} = {expert_dtype!r}: quantized expert weights need a "
                              "quantization_config (fp8 with expert_dtype 'fp4', mxfp4, or block-scaled fp8)")
        return None
    return parse_quantization_config(view.data["quantization_config"], view.path("quantization_config"),
                                     expert_dtype=expert_dtype, expert_dtype_key=view.path("expert_dtype"))


def _quantized_experts(moe: DraftMoeFFNSpec, quantization: QuantSpec | None, layer: int,
                       view: _View, hidden_size: int) -> DraftMoeFFNSpec:
    """The layer's spec with the checkpoint's quantization when its routed experts
    (`model.layers.N.mlp.experts`) are stored quantized; FP4 experts need H and I in whole groups of 32."""
    if quantization is None or not quantization.converts(f"model.layers.{layer}.mlp.experts"):
        return moe
    if quantization.expert_dtype == "fp4":
        group = quantization.experts.block[1]
        for key, size in (("hidden_size", hidden_size), ("moe_intermediate_size", moe.intermediate_size)):
            if size % group:
                raise ConfigError(f"{view.path(key)} = {size}: {view.path('expert_dtype')} = 'fp4' experts carry "
                                  f"one e8m0 scale per {group} inputs, so it must be a multiple of {group}")
    return msgspec.structs.replace(moe, quantization=quantization)


def _detect_family(config: dict) -> Family:
    if "moe_preset" in config or "dflash_config" in config:
        return SPECFORGE
    model_type = config.get("model_type")
    if model_type in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[model_type]
    for arch in config.get("architectures") or ():
        if arch in BY_ARCHITECTURE:
            return BY_ARCHITECTURE[arch]
    raise ConfigError(f"model_type = {model_type!r} (architectures = {config.get('architectures')!r}) has "
                      f"expert fields but is not a supported MoE family; supported model_type: "
                      f"{', '.join(sorted(BY_MODEL_TYPE))}, or a SpecForge draft (moe_preset / dflash_config)")


def _knobs(view: _View, family: Family) -> dict[str, Any]:
    """Routing/activation values: family defaults < SpecForge preset < explicit keys; hardcoded checked."""
    values = dict(family.reads)
    if family is SPECFORGE and view.has("moe_preset"):
        preset = view.get("moe_preset", str)
        if preset not in SPECFORGE_PRESETS:
            raise ConfigError(f"{view.path('moe_preset')} = {preset!r}: expected one of {sorted(SPECFORGE_PRESETS)}")
        values.update(SPECFORGE_PRESETS[preset])
    for key in family.reads:
        if view.has(key):
            values[key] = view.get(key, _KNOB_TYPES[key])
    for key, only in family.fixed.items():
        if view.has(key) and view.get(key, _KNOB_TYPES[key]) != only:
            raise ConfigError(f"{view.path(key)} = {view.data[key]!r} is not supported: "
                              f"{family.name} always uses {only!r}")
        values[key] = only
    return values


def _router_bias(view: _View, family: Family, values: dict[str, Any]) -> RouterBias:
    """Family's fixed meaning of `gate.bias`, or SpecForge's: noaux_tc = selection, moe_router_bias = logit."""
    if family.bias is not None:
        return family.bias
    balance = values["balance"]
    if balance not in ("none", "aux_loss", "noaux_tc"):
        raise ConfigError(f"{view.path('balance')} = {balance!r}: expected 'none', 'aux_loss' or 'noaux_tc'")
    topk_method = view.get("topk_method", str, "noaux_tc" if balance == "noaux_tc" else "greedy")
    if topk_method not in ("greedy", "noaux_tc"):
        raise ConfigError(f"{view.path('topk_method')} = {topk_method!r}: expected 'greedy' or 'noaux_tc'")
    if view.has("balance") and view.has("topk_method") and (balance == "noaux_tc") != (topk_method == "noaux_tc"):
        raise ConfigError(f"{view.path('balance')} = {balance!r} contradicts "
                          f"{view.path('topk_method')} = {topk_method!r}")
    # The export normalizer sets moe_router_bias from the training-time router centering.
    center = (view.data.get("dflash_config") or {}).get("moe_router_center")
    logit = view.get("moe_router_bias", bool, center not in (None, "none"))
    if logit and topk_method == "noaux_tc":
        raise ConfigError(f"{view.path('moe_router_bias')} = true with topk_method = 'noaux_tc': gate.bias "
                          "cannot be both a logit bias and a selection bias")
    return "selection" if topk_method == "noaux_tc" else "logit" if logit else "none"


def _moe_spec(view: _View, family: Family, count: tuple[str, int]) -> DraftMoeFFNSpec:
    e_key, num_experts = count
    top = view.first(_TOP_K_KEYS, PosInt)
    if top is None:
        raise ConfigError(f"{view.path(_TOP_K_KEYS[0])} is missing ({view.path(e_key)} = {num_experts})")
    k_key, top_k = top
    if top_k > num_experts:
        raise ConfigError(f"{view.path(k_key)} = {top_k} must be <= {view.path(e_key)} = {num_experts}")
    size = view.first(family.expert_size_keys, PosInt)
    if size is None:
        raise ConfigError(f"{view.path(family.expert_size_keys[0])} is missing")
    values = _knobs(view, family)
    scoring = values["scoring_func"]
    if "scoring_func" in family.reads and scoring not in _SCORING:
        raise ConfigError(f"{view.path('scoring_func')} = {scoring!r}: expected one of {list(_SCORING)}")
    n_group, topk_group = values["n_group"], values["topk_group"]
    if num_experts % n_group:
        raise ConfigError(f"{view.path('n_group')} = {n_group} must divide {view.path(e_key)} = {num_experts}")
    if topk_group > n_group:
        raise ConfigError(f"{view.path('topk_group')} = {topk_group} must be <= {view.path('n_group')} = {n_group}")
    if top_k > topk_group * (num_experts // n_group):
        raise ConfigError(f"{view.path(k_key)} = {top_k} exceeds the {topk_group * (num_experts // n_group)} "
                          f"experts of topk_group = {topk_group} groups")
    router = _convert(RouterSpec, {
        "num_experts": num_experts, "top_k": top_k, "scoring": scoring, "norm_topk_prob": values["norm_topk_prob"],
        "renorm_eps": family.renorm_eps, "routed_scaling_factor": values["routed_scaling_factor"],
        "n_group": n_group, "topk_group": topk_group, "bias": _router_bias(view, family, values),
    })
    shared_size, shared_gate = _shared_expert(view, family, values, size[1])
    return _convert(DraftMoeFFNSpec, {
        "router": router, "intermediate_size": size[1], "activation": _activation(view, family, values),
        "expert_bias": family.expert_bias, "shared_intermediate_size": shared_size, "shared_gate": shared_gate,
    })


def _activation(view: _View, family: Family, values: dict[str, Any]) -> ActivationSpec:
    if family.activation == "swigluoai":
        return ActivationSpec(kind="swigluoai", limit=values["swiglu_limit"], alpha=values["swiglu_alpha"])
    _check_hidden_act(view)
    return ActivationSpec(kind="swiglu", limit=values["swiglu_limit"])


def _check_hidden_act(view: _View) -> None:
    act = view.get("hidden_act", str, "silu")
    if act not in ("silu", "swiglu"):
        raise ConfigError(f"{view.path('hidden_act')} = {act!r}: only silu (SwiGLU) MLPs are supported")


def _shared_expert(view: _View, family: Family, values: dict[str, Any], expert_size: int) -> tuple[int, bool]:
    """(shared intermediate size S, sigmoid-gated?); S = 0 means no shared expert."""
    if family.shared == "none":
        return 0, False
    if family.shared == "qwen":
        return view.get("shared_expert_intermediate_size", PosInt), True
    n_shared = values["n_shared_experts"]
    if family.shared == "deepseek":
        return expert_size * n_shared, False
    if n_shared not in (0, 1):
        raise ConfigError(f"{view.path('n_shared_experts')} = {n_shared}: SpecForge drafts have 0 or 1 shared expert")
    gate = values["shared_expert_gate"]
    if gate not in ("none", "sigmoid"):
        raise ConfigError(f"{view.path('shared_expert_gate')} = {gate!r}: expected 'none' or 'sigmoid'")
    size = view.get("shared_expert_intermediate_size", PosInt, expert_size)
    return (size, gate == "sigmoid") if n_shared else (0, False)


def _dense_spec(view: _View) -> DraftDenseFFNSpec:
    _check_hidden_act(view)
    return DraftDenseFFNSpec(intermediate_size=view.get("intermediate_size", PosInt))


def _hash_spec(view: _View, moe: DraftMoeFFNSpec) -> DraftMoeFFNSpec:
    """The MoE spec of a hash-routed layer: `moe`'s, with experts from `tid2eid` (no selection bias:
    DeepSeek-V4's hash layers carry `gate.tid2eid` and no `gate.bias`)."""
    router = _convert(RouterSpec, {**msgspec.structs.asdict(moe.router), "hash_routed": True, "bias": "none",
                                   "vocab_size": view.get("vocab_size", PosInt)})
    return msgspec.structs.replace(moe, router=router)


def _moe_schedule(view: _View, family: Family, num_layers: int) -> list[str]:
    """Per layer: "dense", "moe" or "hash_moe", from a layer-type list or the HF schedule keys.

    `num_hash_layers` N makes the first N layers hash-routed (DeepSeek-V4); they must be MoE layers.
    """
    lists = [k for k in _LAYER_TYPE_KEYS if view.has(k)]
    num_hash = view.get("num_hash_layers", NonNegInt, family.hash_layers if not lists else 0)
    first_dense = view.get("first_k_dense_replace", NonNegInt, 0)
    freq = view.get("moe_layer_freq", PosInt, 1)
    step = view.get("decoder_sparse_step", PosInt, 1)
    mlp_only = view.get("mlp_only_layers", list[NonNegInt], [])
    if lists:
        key = lists[0]
        if len(lists) > 1 and view.data[lists[0]] != view.data[lists[1]]:
            raise ConfigError(f"{view.path(lists[0])} and {view.path(lists[1])} disagree")
        if (first_dense, freq, step) != (0, 1, 1) or mlp_only:
            raise ConfigError(f"{view.path(key)} and first_k_dense_replace / moe_layer_freq / decoder_sparse_step / "
                              "mlp_only_layers both set the dense/MoE layers; give one")
        kinds = view.get(key, list[str])
        if len(kinds) != num_layers:
            raise ConfigError(f"{view.path(key)} has {len(kinds)} entries, num_hidden_layers = {num_layers}")
        for i, kind in enumerate(kinds):
            if kind not in ("dense", "moe", "hash_moe"):
                raise ConfigError(f"{view.path(key)}[{i}] = {kind!r}: expected 'dense', 'moe' or 'hash_moe'")
        if view.has("num_hash_layers") and num_hash != kinds.count("hash_moe"):
            raise ConfigError(f"{view.path('num_hash_layers')} = {num_hash} but {view.path(key)} has "
                              f"{kinds.count('hash_moe')} 'hash_moe' layers")
        return kinds
    for layer in mlp_only:
        if layer >= num_layers:
            raise ConfigError(f"{view.path('mlp_only_layers')} has {layer}, num_hidden_layers = {num_layers}")
    # Qwen2/3-MoE: not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0;
    # DeepSeek: i >= first_k_dense_replace and i % moe_layer_freq == 0. Absent keys are neutral.
    kinds = [
        "moe" if i not in mlp_only and (i + 1) % step == 0 and i >= first_dense and i % freq == 0 else "dense"
        for i in range(num_layers)
    ]
    default = "" if view.has("num_hash_layers") else f" (absent: the {family.name} default)"
    if num_hash > num_layers:
        raise ConfigError(f"{view.path('num_hash_layers')} = {num_hash}{default} exceeds num_hidden_layers = {num_layers}")
    dense = [i for i in range(num_hash) if kinds[i] == "dense"]
    if dense:
        raise ConfigError(f"{view.path('num_hash_layers')} = {num_hash}{default}: layers {dense} are dense, "
                          "a hash-routed layer must be a MoE layer")
    return ["hash_moe"] * num_hash + kinds[num_hash:]


def _convert(cls: type, fields: dict[str, Any]) -> Any:
    """Build a spec Struct with its type/range checks (a bare constructor would skip them)."""
    try:
        return msgspec.convert(fields, cls)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{cls.__name__}: {e}") from None
