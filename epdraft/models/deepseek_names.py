"""SpecForge's DeepSeek-V4 / V4.1 DSpark export names (`DSparkV4DraftModel.state_dict()`) <-> `DeepseekDSparkDraft`'s.

The export keeps DeepSeek's per-stage names under `mtp.{i}.`: `attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,
wo_b}.weight`, `attn.attn_sink`, `attn_norm.weight`, `ffn_norm.weight`, `hc_{attn,ffn}_{fn,base,scale}`,
`ffn.gate.{weight,bias}`, `ffn.experts.{e}.w{1,2,3}.weight`, `ffn.shared_experts.w{1,2,3}.weight`;
stage 0 adds `main_proj.weight`, `main_norm.weight`; the last stage `norm.weight`,
`hc_head_{fn,base,scale}` (V4 only: V4.1's readout has no weights, so a V4.1 draft has no `hc_head.*` and
the loader reports an export's as unused). The heads are `markov_head.*`, `confidence_head.proj.weight` at the root
(SpecForge also accepts the official `mtp.{last}.markov_head.*` / `confidence_head.*`: so do we).
FFN tensors become `layers.{i}.mlp.*`, which the FFN loader reads in DeepSeek's naming.

DeepSeek releases the draft inside the target's checkpoint: `mtp.{i}.*` beside the target's own
`layers.{j}.*`, `embed.weight`, `head.weight`, ... (FP8 linears with `.scale`, FP4 routed experts:
`epdraft.loading.quantized`). `bundled_draft_tensors` keeps the draft's names of such a checkpoint,
so that none of the target's tensors is mistaken for the draft's and no shard holding only the
target's is ever opened.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from epdraft.loading import TensorSource
from epdraft.loading.source import Index
from epdraft.models.deepseek_attention import DEEPSEEK_ATTENTION_NAMES

_STAGE = re.compile(r"mtp\.(\d+)\.(.+)")
_HC = re.compile(r"hc_(attn|ffn)_(fn|base|scale)")
_ROOT_HEADS = ("markov_head.", "confidence_head.")
_TARGET_LAYER = "layers."
"""The target's own decoder layers in DeepSeek's checkpoint naming: a draft export has none (its stages are `mtp.*`)."""


def bundled_draft_tensors(weight_map: Mapping[str, Path]) -> dict[str, Path]:
    """The draft's part of a checkpoint: only `mtp.*` when the target's own layers (`layers.*`) are there too
    (the draft bundled in its target's checkpoint); a draft-only export as it is."""
    if not any(name.startswith(_TARGET_LAYER) for name in weight_map):
        return dict(weight_map)
    return {name: file for name, file in weight_map.items() if name.startswith("mtp.")}


def own_name(export_name: str, num_layers: int) -> str:
    """The draft's parameter name of an export tensor; names outside the layout come back unchanged
    (the loader then reports them as unused)."""
    m = _STAGE.fullmatch(export_name)
    if m is None:
        return export_name
    i, rest = int(m.group(1)), m.group(2)
    if rest.startswith("attn.") and rest[5:] in DEEPSEEK_ATTENTION_NAMES:
        return f"layers.{i}.attn.{DEEPSEEK_ATTENTION_NAMES[rest[5:]]}"
    if rest in ("attn_norm.weight", "ffn_norm.weight"):
        return f"layers.{i}.{rest}"
    if hc := _HC.fullmatch(rest):
        return f"layers.{i}.{hc.group(1)}_hc.{hc.group(2)}"
    if rest.startswith("ffn."):
        return f"layers.{i}.mlp.{rest[4:]}"
    if i == 0 and rest in ("main_proj.weight", "main_norm.weight"):
        return rest
    if i == num_layers - 1:
        if rest == "norm.weight" or rest.startswith(_ROOT_HEADS):
            return rest
        if rest.startswith("hc_head_"):
            return f"hc_head.{rest.removeprefix('hc_head_')}"
    return export_name


class DeepseekExportSource:
    """A TensorSource of a SpecForge DSpark V4 export under the draft's own names (`own_name`)."""

    def __init__(self, source: TensorSource, num_layers: int) -> None:
        self._source = source
        self._names = {own_name(n, num_layers): n for n in source.keys()}

    def keys(self) -> Iterable[str]:
        return self._names.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self._source.shape(self._names[name])

    def get(self, name: str, index: Index = ()) -> torch.Tensor:
        return self._source.get(self._names[name], index)

    @property
    def dequantizes(self) -> bool:
        """Whether the wrapped source reads quantized tensors dequantized (a `QuantizedSource`)."""
        return getattr(self._source, "dequantizes", False)

    def stored_names(self, name: str) -> tuple[str, str] | None:
        """The stored (values, scales) names of own tensor `name` (a `QuantizedSource` underneath only)."""
        return self._source.stored_names(self._names[name])

    def get_stored(self, name: str, index: Index = ()) -> torch.Tensor:
        """A stored tensor by its checkpoint name (as `stored_names` gives it)."""
        return self._source.get_stored(name, index)


def to_export_state_dict(model: torch.nn.Module, num_layers: int) -> dict[str, torch.Tensor]:
    """The draft's tensors under SpecForge's export names (every expert on this rank): the inverse of
    `DeepseekExportSource`, used to write tiny test drafts."""
    inverse = {f"layers.{i}.attn.{ours}": f"mtp.{i}.attn.{theirs}"
               for i in range(num_layers) for theirs, ours in DEEPSEEK_ATTENTION_NAMES.items()}  # fmt: skip
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().clone().contiguous()
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if name in inverse:
            out[inverse[name]] = t
        elif m and m.group(2).startswith(("attn_hc.", "ffn_hc.")):
            sub, part = m.group(2).split(".")
            out[f"mtp.{m.group(1)}.hc_{sub.removesuffix('_hc')}_{part}"] = t
        elif m and m.group(2).startswith("mlp."):
            out.update(_ffn_export(int(m.group(1)), m.group(2)[4:], t))
        elif m:
            out[f"mtp.{m.group(1)}.{m.group(2)}"] = t
        elif name.startswith("hc_head."):
            out[f"mtp.{num_layers - 1}.hc_head_{name.removeprefix('hc_head.')}"] = t
        elif name == "norm.weight":
            out[f"mtp.{num_layers - 1}.norm.weight"] = t
        elif name.startswith(("main_proj.", "main_norm.")):
            out[f"mtp.0.{name}"] = t
        else:
            out[name] = t
    return out


def _ffn_export(i: int, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """One FFN tensor of layer i in DeepSeek's export naming (stacked experts split per expert)."""
    prefix = f"mtp.{i}.ffn."
    if name == "experts.w13":
        half = t.shape[1] // 2
        return {**{f"{prefix}experts.{e}.w1.weight": t[e, :half].contiguous() for e in range(t.shape[0])},
                **{f"{prefix}experts.{e}.w3.weight": t[e, half:].contiguous() for e in range(t.shape[0])}}
    if name == "experts.w2":
        return {f"{prefix}experts.{e}.w2.weight": t[e].contiguous() for e in range(t.shape[0])}
    shared = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    if name.startswith("shared."):
        proj = name.split(".")[1]
        return {f"{prefix}shared_experts.{shared[proj]}.weight": t}
    if name.startswith("router."):
        return {f"{prefix}gate.{name.removeprefix('router.')}": t}
    raise KeyError(f"layer {i}: {name}: no DeepSeek export name")
