"""DraftModelSpec: the geometry of a DFlash / DSpark draft, read once from its config.json.

SpecForge exports keep some keys at top level and some under `dflash_config` (the DSpark export
normalizer copies the Markov keys up); a target checkpoint that bundles its DSpark head carries them
as `dspark_*` keys (`dspark_block_size`, `dspark_markov_rank`, `dspark_markov_head_type`,
`dspark_noise_token_id`, `dspark_target_layer_ids`) or under a `dspark_config` table (SGLang's
`parse_dspark_draft_config`). Any of these places is accepted; two that disagree are refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from epdraft.config.hf import DraftMixFFNSpec
from epdraft.errors import ConfigError

MarkovHeadType = Literal["vanilla", "gated", "rnn"]
LayerType = Literal["full_attention", "sliding_attention"]
Readout = Literal["mask_filling", "autoregressive"]
"""How the block's hidden rows become drafts (sglang PR #33831). `mask_filling` (SpecForge training):
row k >= 1 predicts the token at anchor + k, B-1 drafts, verify width B. `autoregressive` (DeepSpec,
SGLang's default): row k >= 0 predicts the token at anchor + k + 1, B drafts, verify width B + 1."""

_MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
PosInt = Annotated[int, msgspec.Meta(ge=1)]


class DeepseekDSparkSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The DeepSeek-V4 / V4.1 DSpark layer geometry (SpecForge `DSparkV4DraftModel`): low-rank q, one
    shared K=V head, grouped low-rank output, a block-anchored context window, mHC residual streams.

    V4.1 (`attention_mode: "deepseek_v41"`) is built from the architecture description (reference
    draft_models.md 6b), not yet checked against a released V4.1 export.

    `kv_fake_quant`: the export was trained with the K=V row's non-rope channels rounded through FP8
    e4m3 with power-of-two scales per 64 channels (SpecForge's QAT of the official serving path's
    `act_quant(..., "ue8m0")`), so serving applies the same round trip to every K=V row (context and
    block): without it the draft sees K/V it was not trained on (lossless either way, fewer accepts).
    """

    variant: Literal["v4", "v41"] = "v4"
    """v4: a parameter-free per-head RMS norm of q, mHC mixes from each sublayer's own streams, the
    `hc_head` readout. v41: no q norm, single-pass mHC (lagged pre mix), readout by the last pre mix."""
    q_lora_rank: PosInt
    rope_head_dim: PosInt
    o_groups: PosInt
    o_lora_rank: PosInt
    window: Annotated[int, msgspec.Meta(ge=1, description="context rows before the anchor every block query sees")]
    hc_mult: PosInt
    hc_sinkhorn_iters: PosInt
    hc_eps: Annotated[float, msgspec.Meta(gt=0.0)]
    kv_fake_quant: bool

    @property
    def q_norm(self) -> bool:
        return self.variant == "v4"

    @property
    def single_pass(self) -> bool:
        """V4.1's single-pass mHC (and its readout without `hc_head`)."""
        return self.variant == "v41"

    def describe(self, num_heads: int, head_dim: int) -> str:
        """One line of the attention and residual, for `epdraft check`."""
        return (f"deepseek {self.variant}: {num_heads} q heads over 1 K=V head {head_dim} (rope {self.rope_head_dim}, "
                f"sinks), window {self.window}, o {self.o_groups}x{self.o_lora_rank}; mHC x{self.hc_mult}")  # fmt: skip


_LAYER_TYPES = ("full_attention", "sliding_attention")
_ATTENTION_MODES = {"deepseek_v4": "v4", "deepseek_v41": "v41"}
"""SpecForge's `attention_mode` of a DSparkV4DraftModel (absent: V4) -> DeepseekDSparkSpec.variant."""


class DraftModelSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything a draft needs besides its weights. Build with `from_config`, never directly."""

    kind: Literal["dflash", "dspark", "dspark_v4"]
    hidden_size: Annotated[int, msgspec.Meta(ge=1)]
    num_heads: Annotated[int, msgspec.Meta(ge=1)]
    num_kv_heads: Annotated[int, msgspec.Meta(ge=1)]
    head_dim: Annotated[int, msgspec.Meta(ge=2)]
    rope_theta: Annotated[float, msgspec.Meta(gt=0.0)]
    rms_norm_eps: Annotated[float, msgspec.Meta(gt=0.0)]
    num_layers: Annotated[int, msgspec.Meta(ge=1)]
    block_size: Annotated[int, msgspec.Meta(ge=2, description="anchor + block_size-1 drafts")]
    mask_token_id: Annotated[int, msgspec.Meta(ge=0)]
    target_layer_ids: tuple[int, ...]
    layer_types: tuple[LayerType, ...]
    vocab_size: Annotated[int, msgspec.Meta(ge=1)]
    sliding_window: Annotated[int, msgspec.Meta(ge=1, description="keys within this many positions")] | None = None
    readout: Readout = "mask_filling"
    attention_bias: bool = False
    markov_rank: Annotated[int, msgspec.Meta(ge=0, description="0 = no Markov head (DFlash)")] = 0
    markov_head_type: MarkovHeadType = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    ffn: DraftMixFFNSpec
    deepseek: DeepseekDSparkSpec | None = None
    """The DeepSeek layer geometry: set exactly when kind = "dspark_v4"."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if not self.target_layer_ids:
            raise ConfigError("dflash_config.target_layer_ids must name at least one target layer")
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_layers}"
            )
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ConfigError("layer_types has sliding_attention layers but sliding_window is missing")
        if self.ffn.num_layers != self.num_layers:
            raise ConfigError(f"FFN spec has {self.ffn.num_layers} layers, num_hidden_layers is {self.num_layers}")
        if (self.kind == "dspark_v4") != (self.deepseek is not None):
            raise ConfigError(f"kind = {self.kind!r}: the DeepSeek layer geometry belongs to dspark_v4 drafts only")
        if self.deepseek is not None:
            _check_deepseek(self)
        if self.kind in ("dspark", "dspark_v4") and self.markov_rank <= 0:
            raise ConfigError(f"markov_rank = {self.markov_rank}: a DSpark draft needs markov_rank > 0")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank <= 0:
            raise ConfigError("confidence_head_with_markov = true needs a Markov head (markov_rank > 0)")

    @property
    def num_drafts(self) -> int:
        """Drafts per request per step: B-1 (mask-filling readout) or B (autoregressive)."""
        return self.block_size - 1 if self.readout == "mask_filling" else self.block_size

    def window(self, layer: int) -> int | None:
        """The layer's sliding window (a key at position p is seen from query positions < p + window), None if full."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def num_target_features(self) -> int:
        """K: how many target layers feed `fc` (its input is K * hidden_size wide)."""
        return len(self.target_layer_ids)

    @classmethod
    def from_config(cls, config: dict[str, Any], *, source: str = "config.json") -> "DraftModelSpec":
        """Parse a SpecForge DFlash/DSpark export's config dict; ConfigError names `source` and the key."""
        tables = {"": config}
        for name in ("dflash_config", "dspark_config"):
            table = config.get(name) or {}
            if not isinstance(table, dict):
                raise ConfigError(f"{source}: {name} must be an object, got {type(table).__name__}")
            tables[name + "."] = table

        def pick(key: str, default: Any = msgspec.UNSET, *, prefixed: str | None = None) -> Any:
            """The key's value from any place it may live; ConfigError if two places disagree."""
            found = [(where + key, t[key]) for where, t in tables.items() if t.get(key) is not None]
            if prefixed is not None and config.get(prefixed) is not None:
                found.append((prefixed, config[prefixed]))
            for where, value in found[1:]:
                if value != found[0][1]:
                    raise ConfigError(f"{source}: {where} = {value!r} contradicts {found[0][0]} = {found[0][1]!r}")
            if found:
                return found[0][1]
            if default is msgspec.UNSET:
                raise ConfigError(f"{source}: missing key {key!r} (top level, dflash_config or dspark_config)")
            return default

        hidden = pick("hidden_size")
        heads = pick("num_attention_heads")
        num_layers = pick("num_hidden_layers")
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ConfigError(f"{source}: num_hidden_layers = {num_layers!r} must be a positive integer")
        projector = tables["dflash_config."].get("projector_type", "")
        markov_rank = pick("markov_rank", 0, prefixed="dspark_markov_rank")
        archs = " ".join(config.get("architectures") or [])
        v4 = projector == "dspark_v4" or "DSparkV4DraftModel" in archs
        kind = "dspark_v4" if v4 else "dspark" if projector == "dspark" or "DSpark" in archs or markov_rank else "dflash"
        markov_head_type = pick("markov_head_type", "vanilla", prefixed="dspark_markov_head_type")
        if markov_head_type not in _MARKOV_HEAD_TYPES:
            raise ConfigError(f"{source}: markov_head_type = {markov_head_type!r}: expected one of {list(_MARKOV_HEAD_TYPES)}")
        layer_types = pick("layer_types", None) or ["full_attention"] * num_layers
        for i, t in enumerate(layer_types):
            if t not in _LAYER_TYPES:
                raise ConfigError(f"{source}: layer_types[{i}] = {t!r}: expected one of {list(_LAYER_TYPES)}")
        window = pick("sliding_window", None) if "sliding_attention" in layer_types else None
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
            raise ConfigError(f"{source}: sliding_window = {window!r} must be a positive integer")
        mask_filling = pick("mask_filling", True)
        if not isinstance(mask_filling, bool):
            raise ConfigError(f"{source}: mask_filling = {mask_filling!r} must be true or false")
        raw = {
            "kind": kind,
            "hidden_size": hidden,
            "num_heads": heads,
            "num_kv_heads": pick("num_key_value_heads", heads),
            "head_dim": pick("head_dim", None) or _default_head_dim(hidden, heads, source),
            "rope_theta": _rope_theta(config, source),
            "rms_norm_eps": pick("rms_norm_eps", 1e-6),
            "num_layers": num_layers,
            "block_size": pick("block_size", 16, prefixed="dspark_block_size"),
            "mask_token_id": pick("mask_token_id", prefixed="dspark_noise_token_id"),
            "target_layer_ids": pick("target_layer_ids", msgspec.UNSET, prefixed="dspark_target_layer_ids"),
            "layer_types": layer_types,
            "vocab_size": pick("vocab_size"),
            "sliding_window": window,
            "readout": "mask_filling" if mask_filling else "autoregressive",
            "attention_bias": pick("attention_bias", False),
            "markov_rank": markov_rank,
            "markov_head_type": markov_head_type,
            "enable_confidence_head": pick("enable_confidence_head", False),
            "confidence_head_with_markov": pick("confidence_head_with_markov", False),
            "ffn": DraftMixFFNSpec.from_config(config),
        }
        if v4:
            raw.update(_deepseek_fields(config, pick, source))
        try:
            return msgspec.convert(raw, cls)
        except msgspec.ValidationError as e:
            raise ConfigError(f"{source}: {e}") from e


def _deepseek_fields(config: dict[str, Any], pick: Any, source: str) -> dict[str, Any]:
    """The raw fields a dspark_v4 spec adds or replaces: the DeepSeek geometry, one window for every
    layer (not `layer_types`), and the FFN as SpecForge's V4 MoE (sqrtsoftplus, gate.bias selects
    experts: noaux_tc, one shared expert, clamped SwiGLU)."""
    preset = config.get("moe_preset", "deepseek_v4")
    if preset != "deepseek_v4":
        raise ConfigError(f"{source}: moe_preset = {preset!r}: a DSparkV4DraftModel's MoE is 'deepseek_v4'")
    if config.get("layer_types") is not None:
        raise ConfigError(f"{source}: layer_types: a DSparkV4DraftModel windows every layer (sliding_window)")
    if pick("markov_head_type", "vanilla") != "vanilla":
        raise ConfigError(f"{source}: markov_head_type = {pick('markov_head_type')!r}: DSparkV4DraftModel has "
                          "a vanilla Markov head only")
    mode = pick("attention_mode", "deepseek_v4")
    if mode not in _ATTENTION_MODES:
        raise ConfigError(
            f"{source}: attention_mode = {mode!r}: a DSparkV4DraftModel's is one of {list(_ATTENTION_MODES)}"
        )
    deepseek = {
        "variant": _ATTENTION_MODES[mode],
        "q_lora_rank": pick("q_lora_rank"),
        "rope_head_dim": pick("qk_rope_head_dim"),
        "o_groups": pick("o_groups"),
        "o_lora_rank": pick("o_lora_rank"),
        "window": _context_window(pick, source),
        "hc_mult": pick("hc_mult"),
        "hc_sinkhorn_iters": pick("hc_sinkhorn_iters"),
        "hc_eps": pick("hc_eps"),
        "kv_fake_quant": pick("kv_fake_quant", True),
    }
    return {
        "deepseek": deepseek,
        "head_dim": pick("head_dim"),
        "sliding_window": None,
        "layer_types": ["full_attention"] * config["num_hidden_layers"],
        "ffn": DraftMixFFNSpec.from_config({**config, "moe_preset": "deepseek_v4"}),
    }


def _context_window(pick: Any, source: str) -> Any:
    """The window from `sliding_window` or SpecForge's V4.1 `context_window`; both given must agree."""
    sliding, context = pick("sliding_window", None), pick("context_window", None)
    if sliding is not None and context is not None and sliding != context:
        raise ConfigError(f"{source}: context_window = {context!r} contradicts sliding_window = {sliding!r} "
                          "(both give the DeepSeek context window)")
    window = context if context is not None else sliding
    if window is None:
        raise ConfigError(f"{source}: missing key 'sliding_window' (or dflash_config.context_window)")
    return window


def _check_deepseek(spec: DraftModelSpec) -> None:
    """ConfigError, naming the config key, for a dspark_v4 geometry the DeepSeek layers cannot lay out."""
    d = spec.deepseek
    if spec.num_kv_heads != 1:
        raise ConfigError(f"num_key_value_heads = {spec.num_kv_heads}: DeepSeek DSpark attention has one K=V head")
    if spec.num_heads % d.o_groups:
        raise ConfigError(f"o_groups = {d.o_groups} must divide num_attention_heads = {spec.num_heads}")
    if d.rope_head_dim % 2 or d.rope_head_dim > spec.head_dim:
        raise ConfigError(f"qk_rope_head_dim = {d.rope_head_dim} must be even and <= head_dim = {spec.head_dim}")
    if spec.attention_bias:
        raise ConfigError("attention_bias = true: DeepSeek DSpark attention has no biases")
    if spec.markov_head_type != "vanilla":
        raise ConfigError(f"markov_head_type = {spec.markov_head_type!r}: DSparkV4DraftModel's is vanilla")
    if spec.enable_confidence_head and not spec.confidence_head_with_markov:
        raise ConfigError("confidence_head_with_markov = false: DSparkV4DraftModel's confidence head always "
                          "reads the Markov embedding")


def _default_head_dim(hidden: Any, heads: Any, source: str) -> int:
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads < 1:
        raise ConfigError(f"{source}: hidden_size / num_attention_heads must be positive integers")
    return hidden // heads


def _rope_theta(config: dict[str, Any], source: str) -> float:
    """rope_theta from transformers v4 (`rope_theta`) or v5 (`rope_parameters`); only default RoPE is served."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    for key, table in (("rope_parameters", params), ("rope_scaling", scaling)):
        rope_type = table.get("rope_type", table.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"{source}: {key}.rope_type = {rope_type!r}: only default RoPE is supported")
    theta = params.get("rope_theta", config.get("rope_theta", 1_000_000.0))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{source}: rope_theta = {theta!r} must be a positive number")
    return float(theta)


def check_against_target(spec: DraftModelSpec, *, hidden_size: int, num_layers: int, vocab_size: int) -> None:
    """Raise ConfigError if the draft cannot run on this target (called by the runtime before step 0)."""
    if spec.hidden_size != hidden_size:
        raise ConfigError(
            f"draft hidden_size ({spec.hidden_size}) != target hidden_size ({hidden_size}): the draft "
            "reads the target's embeddings and lm_head, so they must match"
        )
    bad = [j for j in spec.target_layer_ids if not 0 <= j < num_layers]
    if bad:
        raise ConfigError(f"dflash_config.target_layer_ids {bad} outside the target's {num_layers} layers")
    if spec.mask_token_id >= vocab_size:
        raise ConfigError(f"mask_token_id ({spec.mask_token_id}) outside the target vocabulary ({vocab_size})")
