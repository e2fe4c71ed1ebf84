"""`epdraft check DRAFT_DIR_OR_CONFIG_JSON`: print the per-layer plan a draft (or target) config asks for.

Reads `DIR/config.json` (or the JSON file given), parses it exactly as the runtime does and prints,
per layer (identical consecutive layers collapsed into a range): dense or MoE, experts x
intermediate size, top-k, router (`hash` for a token-id-routed layer), shared expert, activation,
the routed experts' bytes as stored (bf16, or the checkpoint's quantization: mxfp4 and DeepSeek's
fp4 4.25 bits a weight, fp8 8 bits plus its scales) and the attention (full, or sliding with its window). A DFlash /
DSpark draft's header adds its block size, readout, Markov head and confidence head; a quantized
checkpoint its format and whether a CUDA bf16 run keeps the experts quantized.
A config the runtime cannot run exits 2 with one line naming the key; a parallel config (TOML or
YAML, a shipped config's name, or JSON with a `cluster` section or only parallel-config sections)
exits 2 pointing to `epdraft plan`, which checks one against a draft.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from epdraft.config.ffn import ActivationSpec, DraftDenseFFNSpec, DraftMoeFFNSpec, FFNSpec, RouterSpec
from epdraft.config.hf import DraftMixFFNSpec, parse_ffn_config, read_config_json
from epdraft.config.parallel import ParallelConfig, resolve_config_path, shipped_config_names
from epdraft.errors import ConfigError
from epdraft.layers.step_kernels import quantized_experts_reason
from epdraft.models.spec import DraftModelSpec

_BF16_BITS = 16
_COLUMNS = ("layers", "kind", "E x I", "top-k", "router", "shared expert", "activation")
# Formats only a parallel config uses here: a model's config is always JSON.
_PARALLEL_CONFIG_SUFFIXES = (".toml", ".yaml", ".yml")
_DRAFT_KEYS = ("dflash_config", "dspark_config", "dspark_block_size", "dspark_markov_rank", "dspark_target_layer_ids")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="DRAFT_DIR_OR_CONFIG_JSON",
                        help="a draft checkpoint directory (its config.json is read) or a config JSON file")


def main(args: argparse.Namespace) -> int:
    _refuse_parallel_config(args.path)
    config = read_config_json(args.path)
    source = str(_config_file(args.path))
    if _is_parallel_config(config):
        raise ConfigError(_to_plan(source, args.path))
    try:
        spec = parse_ffn_config(config)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    draft = DraftModelSpec.from_config(config, source=source) if any(k in config for k in _DRAFT_KEYS) else None
    print(format_plan(spec, source=source, draft=draft, attention=None if draft else _target_attention(config, source)))
    return 0


def format_plan(
    spec: DraftMixFFNSpec,
    source: str = "",
    *,
    draft: DraftModelSpec | None = None,
    attention: tuple[str, ...] | None = None,
) -> str:
    """The plan as text: a header, the weights' format if quantized, one row per run of identical
    layers, the total expert bytes (as stored).

    `draft` (a DFlash / DSpark draft's spec) adds its block, readout and heads to the header and
    gives each layer's attention; else `attention` (per layer, e.g. from a target's layer_types).
    """
    if draft is not None and draft.deepseek is not None:
        attention = (draft.deepseek.describe(draft.num_heads, draft.head_dim),) * draft.num_layers
    elif draft is not None:
        attention = tuple("full" if draft.window(i) is None else f"sliding {draft.window(i)}" for i in range(draft.num_layers))
    attention = attention or ("full",) * spec.num_layers
    stored = {_stored_format(layer) for layer in spec.layers if isinstance(layer, DraftMoeFFNSpec)}
    fmt = "/".join(sorted(stored)) or "bf16"
    rows = [(*_COLUMNS, f"experts ({fmt})", "attention")]
    total = 0
    for first, last, (layer, attn) in _runs(tuple(zip(spec.layers, attention))):
        layer_bytes = _expert_bytes(layer, spec.hidden_size)
        total += layer_bytes * (last - first + 1)
        span = str(first) if first == last else f"{first}-{last}"
        rows.append((span, *_describe(layer), _human(layer_bytes) if layer_bytes else "-", attn))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    num_moe = len(spec.moe_layers)
    num_hash = sum(isinstance(layer, DraftMoeFFNSpec) and layer.router.hash_routed for layer in spec.layers)
    hashed = f", {num_hash} hash-routed" if num_hash else ""
    header = (f"{source + ': ' if source else ''}family {spec.family}, hidden {spec.hidden_size}, "
              f"{spec.num_layers} layers ({spec.num_layers - num_moe} dense, {num_moe} MoE{hashed})")
    if draft is not None:
        header += "; " + _draft_summary(draft)
    weights = []
    if spec.quantization is not None:
        weights = [f"weights: {spec.quantization.describe()}", _on_cuda(spec)]
    footer = f"routed expert weights ({fmt}): {_human(total)} total ({total} bytes)"
    return "\n".join([header, *weights, *table, footer])


def _refuse_parallel_config(path: str) -> None:
    """Point a parallel config to `epdraft plan`: read as a model's JSON it would only be "invalid JSON".

    Raises ConfigError naming the file when `path` has a TOML/YAML suffix or is a shipped config's name
    (and no file or directory of that name exists here).
    """
    p = Path(path)
    by_name = not p.exists() and len(p.parts) == 1 and p.name in shipped_config_names()
    if p.suffix.lower() in _PARALLEL_CONFIG_SUFFIXES or by_name:
        raise ConfigError(_to_plan(resolve_config_path(p), path))


def _is_parallel_config(config: dict) -> bool:
    """A JSON parallel config: it has a `cluster` section (no model config does), or only the
    parallel config's sections (cluster, draft, target, placement)."""
    sections = set(ParallelConfig.__struct_fields__)
    return "cluster" in config or (bool(config) and set(config) <= sections)


def _to_plan(file: str | Path, path: str) -> str:
    return (f"{file}: a parallel config, not a model's config.json; "
            f"check it against a draft with `epdraft plan {path} DRAFT_DIR`")  # fmt: skip


def _config_file(path: str) -> Path:
    p = Path(path)
    return p / "config.json" if p.is_dir() else p


def _draft_summary(d: DraftModelSpec) -> str:
    """e.g. `dspark block 7, mask_filling readout (6 drafts), markov gated r256, confidence head (+markov)`."""
    text = f"{d.kind} block {d.block_size}, {d.readout} readout ({d.num_drafts} drafts)"
    if d.markov_rank:
        text += f", markov {d.markov_head_type} r{d.markov_rank}"
    if d.enable_confidence_head:
        text += ", confidence head" + (" (+markov)" if d.confidence_head_with_markov else "")
    return text


def _target_attention(config: dict, source: str) -> tuple[str, ...] | None:
    """Per layer `full` / `sliding W` from an HF config's layer_types and sliding_window; None without layer_types."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    types, window = text.get("layer_types"), text.get("sliding_window")
    if not types:
        return None
    if "sliding_attention" in types and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise ConfigError(f"{source}: sliding_window = {window!r} must be a positive integer")
    return tuple(f"sliding {window}" if t == "sliding_attention" else "full" if t == "full_attention" else t
                 for t in types)


def _runs(layers: tuple) -> list[tuple[int, int, object]]:
    """(first, last, item) for each run of equal consecutive items."""
    runs: list[tuple[int, int, object]] = []
    for i, layer in enumerate(layers):
        if runs and runs[-1][2] == layer:
            runs[-1] = (runs[-1][0], i, layer)
        else:
            runs.append((i, i, layer))
    return runs


def _describe(layer: FFNSpec) -> tuple[str, ...]:
    """(kind, E x I, top-k, router, shared expert, activation) cells of one layer."""
    if isinstance(layer, DraftDenseFFNSpec):
        return ("dense", str(layer.intermediate_size), "-", "-", "-", _activation(layer.activation))
    shared = "-"
    if layer.shared_intermediate_size:
        shared = f"{layer.shared_intermediate_size} {'gated' if layer.shared_gate else 'ungated'}"
    act = _activation(layer.activation) + (" +bias" if layer.expert_bias else "")
    return ("MoE", f"{layer.num_experts} x {layer.intermediate_size}", str(layer.top_k),
            _router(layer.router), shared, act)


def _router(router: RouterSpec) -> str:
    """e.g. `softmax renorm`, `sigmoid renorm noaux_tc groups 8/4 x2.5`, `softmax_topk logit-bias`,
    `hash sqrtsoftplus renorm x1.5` (experts from tid2eid)."""
    parts = (["hash"] if router.hash_routed else []) + [router.scoring]
    if router.norm_topk_prob and router.scoring != "softmax_topk":
        parts.append("renorm")
    parts += {"none": [], "selection": ["noaux_tc"], "logit": ["logit-bias"]}[router.bias]
    if router.group_limited:
        parts.append(f"groups {router.n_group}/{router.topk_group}")
    if router.routed_scaling_factor != 1.0:
        parts.append(f"x{router.routed_scaling_factor:g}")
    return " ".join(parts)


def _activation(act: ActivationSpec) -> str:
    text = act.kind if act.kind == "swiglu" else f"{act.kind} alpha {act.alpha:g}"
    return text + (f" clamp {act.limit:g}" if act.limit > 0 else "")


def _on_cuda(spec: DraftMixFFNSpec) -> str:
    """What a CUDA bf16 run (moe_tp = 1) does with the quantized routed experts."""
    layers = [layer for layer in spec.layers if isinstance(layer, DraftMoeFFNSpec) and layer.quantization is not None]
    if not layers:
        return "on CUDA: no routed experts are quantized; quantized tensors are dequantized at load"
    reason = quantized_experts_reason(spec, tp_size=1, device_type="cuda", dtype=torch.bfloat16)
    if reason is None:
        q = layers[0].quantization
        held = "fp4 (as the fused kernels' mxfp4, no bf16 copy)" if q.expert_dtype == "fp4" else q.method
        return f"on CUDA with bf16: routed experts stay {held} for the fused kernels"
    return f"on CUDA with bf16: dequantized at load ({reason})"


def _stored_format(layer: DraftMoeFFNSpec) -> str:
    if layer.quantization is None:
        return "bf16"
    return "fp4" if layer.quantization.expert_dtype == "fp4" else layer.quantization.method


def _expert_bytes(layer: FFNSpec, hidden_size: int) -> int:
    """Stored bytes of one layer's routed experts (scales included for a quantized format)."""
    if not isinstance(layer, DraftMoeFFNSpec):
        return 0
    bits = layer.quantization.experts.bits_per_weight if layer.quantization is not None else _BF16_BITS
    return round(layer.expert_bytes(hidden_size, 1) * bits / 8)


def _human(num_bytes: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"
