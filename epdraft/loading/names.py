"""Every accepted checkpoint naming, as one table: name pattern -> (module slot, form, part).

Names are matched relative to the FFN block; `relative_name` strips a layer prefix
(`layers.N.mlp.`, `model.layers.N.mlp.`, `layers.N.block_sparse_moe.`, `layers.N.ffn.`,
`model.language_model.layers.N.mlp.`). The slot is the module's canonical parameter name
(`router.weight`, `experts.w13`, `shared.gate_proj.weight`, ...); the form says how the source
tensor's layout maps onto it (see `epdraft.loading.ffn`).
"""

from __future__ import annotations

import dataclasses
import re

_LAYER_PREFIX = re.compile(r"(?:model\.(?:language_model\.)?)?layers\.(\d+)\.(?:mlp|block_sparse_moe|ffn)\.(.+)")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One accepted name.

    pattern: full-match regex on the block-relative name; group 1, if any, is the expert index.
    slot: the module parameter it fills.
    form: `whole` | `expert` ([I,H] or [H,I] of one expert) | `stacked` ([E,I,H] / [E,H,I]) |
        `fused_gate_up` ([E,2I,H], gate rows first) | `down_bias` ([E,H]) and the gpt-oss forms
        `oss_gate_up` ([E,H,2I], interleaved), `oss_down` ([E,I,H]), `oss_gate_up_bias` ([E,2I], interleaved).
    part: `gate` | `up` | `down` for expert weights, else "".
    oss_form: the form used instead when the module holds the gpt-oss layout (same names, other layout).
    """

    pattern: re.Pattern
    slot: str
    form: str
    part: str = ""
    oss_form: str | None = None


def _rule(pattern: str, slot: str, form: str = "whole", part: str = "", oss_form: str | None = None) -> Rule:
    return Rule(re.compile(pattern), slot, form, part, oss_form)


_PROJ = (("gate", r"(?:gate_proj|w1)"), ("up", r"(?:up_proj|w3)"), ("down", r"(?:down_proj|w2)"))
"""Qwen / HF names, then DeepSeek / Mixtral names, of the three projections."""

MLP_RULES: tuple[Rule, ...] = tuple(
    _rule(rf"{pat}\.{kind}", f"{part}_proj.{kind}") for part, pat in _PROJ for kind in ("weight", "bias")
)
"""A dense MLP: `gate_proj.weight` or `w1.weight`, ... (and `.bias`)."""

MOE_RULES: tuple[Rule, ...] = (
    _rule(r"(?:gate|router)\.weight", "router.weight"),
    # One key, two meanings (selection or logit bias): the spec says which; the tensor is the same.
    _rule(r"gate\.(?:bias|e_score_correction_bias|balance\.bias)|router\.bias", "router.bias"),
    _rule(r"(?:gate|router)\.tid2eid", "router.tid2eid"),
    *(_rule(rf"experts\.(\d+)\.{pat}\.weight", "experts.w2" if part == "down" else "experts.w13", "expert", part)
      for part, pat in _PROJ),
    *(_rule(rf"experts\.{pat}", "experts.w2" if part == "down" else "experts.w13", "stacked", part)
      for part, pat in (("gate", "w1"), ("up", "w3"), ("down", "w2"))),
    _rule(r"experts\.(?:gate_up_proj|w13_weight)", "experts.w13", "fused_gate_up", oss_form="oss_gate_up"),
    _rule(r"experts\.(?:down_proj|w2_weight)", "experts.w2", "stacked", "down", oss_form="oss_down"),
    _rule(r"experts\.gate_up_proj_bias", "experts.b13", "oss_gate_up_bias"),
    _rule(r"experts\.down_proj_bias", "experts.b2", "down_bias"),
    *(_rule(rf"shared_experts?\.{pat}\.weight", f"shared.{part}_proj.weight") for part, pat in _PROJ),
    _rule(r"shared_expert_gate\.weight|shared_experts\.gate\.weight", "shared.output_gate.weight"),
)
"""A MoE block: router, routed experts in every export layout, shared expert and its gate."""


def relative_name(name: str, layer_id: int | None) -> str | None:
    """`name` relative to the FFN block of `layer_id`; None if it belongs to another layer.

    A name without a layer prefix is taken as already relative to the block.
    """
    m = _LAYER_PREFIX.fullmatch(name)
    if m is None:
        return name
    if layer_id is None or int(m.group(1)) != layer_id:
        return None
    return m.group(2)


def match(relative: str, rules: tuple[Rule, ...]) -> tuple[Rule, int | None] | None:
    """The rule accepting `relative` and its expert index (per-expert names), or None."""
    for rule in rules:
        m = rule.pattern.fullmatch(relative)
        if m is not None:
            return rule, int(m.group(1)) if m.groups() else None
    return None


_DISPLAY = {
    ("router.weight", ""): "gate.weight",
    ("router.bias", ""): "gate.bias",
    ("router.tid2eid", ""): "gate.tid2eid",
    ("experts.w13", "gate"): "experts.{g}.gate_proj.weight",
    ("experts.w13", "up"): "experts.{g}.up_proj.weight",
    ("experts.w2", "down"): "experts.{g}.down_proj.weight",
    ("experts.b13", ""): "experts.gate_up_proj_bias[{g}]",
    ("experts.b2", ""): "experts.down_proj_bias[{g}]",
    ("shared.output_gate.weight", ""): "shared_expert_gate.weight",
}


def display_name(slot: str, expert: int | None, part: str, layer_id: int | None) -> str:
    """The conventional (SpecForge Qwen / HF) name of a missing piece, with its layer prefix."""
    template = _DISPLAY.get((slot, part), slot.replace("shared.", "shared_expert.", 1))
    prefix = f"layers.{layer_id}.mlp." if layer_id is not None else ""
    return prefix + template.format(g=expert)
