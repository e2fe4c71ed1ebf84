"""Load a SpecForge DFlash / DSpark export (config.json + safetensors) into a draft, strictly.

Names follow SpecForge: `fc.weight`, `hidden_norm.weight`, `norm.weight`, `layers.N.self_attn.*`,
`layers.N.{input,post_attention}_layernorm.weight`, `layers.N.mlp.*` (any FFN naming the FFN loader
accepts), `markov_head.*`, `confidence_head.*`; an optional `model.` prefix. The draft borrows the
target's embedding and lm_head, so `embed_tokens.`, `lm_head.`, `rotary_emb.` are skipped as
SGLang's loader does. Any missing tensor fails the whole load with one LoadError listing them all.
A DeepSeek-V4 DSpark export (`mtp.{i}.*`) is read through `deepseek_names.DeepseekExportSource`, from a
draft-only export or out of the target's checkpoint that bundles it (`draft_weight_map`: the index
names the shards; only those holding `mtp.*` are opened, and an EP rank reads only its experts' bytes).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from epdraft.config.hf import read_config_json
from epdraft.dispatch import Dispatcher
from epdraft.errors import ConfigError, LoadError
from epdraft.layers.routed_experts import RoutedExperts
from epdraft.layers.step_kernels import StepKernels
from epdraft.loading import SafetensorsSource, TensorSource, checkpoint_weight_map, quantized_source
from epdraft.models.deepseek_names import DeepseekExportSource, bundled_draft_tensors
from epdraft.models.dflash import DFlashDraft
from epdraft.models.protocol import DRAFT_FAMILIES, DraftModel
from epdraft.models.spec import DraftModelSpec

log = logging.getLogger(__name__)

SKIPPED_PREFIXES = ("embed_tokens.", "lm_head.", "rotary_emb.")
_FFN_NAME = re.compile(r"layers\.\d+\.(?:mlp|block_sparse_moe|ffn)\.")


def read_draft_spec(path: str | Path) -> DraftModelSpec:
    """The DraftModelSpec of a draft export directory (its config.json); ConfigError naming the file."""
    return DraftModelSpec.from_config(read_config_json(path), source=str(Path(path) / "config.json"))


def draft_weight_map(path: str | Path, spec: DraftModelSpec) -> dict[str, Path]:
    """The draft's tensor name -> file of the checkpoint at `path` (see `checkpoint_weight_map`): for a
    dspark_v4 draft bundled in its DeepSeek target's checkpoint, its `mtp.*` tensors only."""
    weight_map = checkpoint_weight_map(path)
    if spec.kind != "dspark_v4":
        return weight_map
    draft = bundled_draft_tensors(weight_map)
    if len(draft) < len(weight_map):
        files = set(weight_map.values())
        log.info("%s: a target checkpoint bundling the draft: %d mtp.* tensor(s) in %d of its %d file(s), the "
                 "target's %d tensor(s) not read", path, len(draft), len(set(draft.values())), len(files),
                 len(weight_map) - len(draft))
    return draft


def load_draft(
    path: str | Path,
    *,
    spec: DraftModelSpec | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    dispatcher: Dispatcher | None = None,
    kernels: StepKernels | None = None,
) -> DraftModel:
    """Build the draft described by `path/config.json` and load its weights (this rank's experts only).

    `spec`: the export's spec when the caller has read it already (config.json is then not read
    again). The family comes from `DRAFT_FAMILIES[spec.kind]`; `dispatcher` places and connects
    the MoE layers (None: every expert here); `kernels`: the rank's resolved compute (None:
    resolved for `device`, `dtype`, the spec and the layout). Raises ConfigError for a config the
    runtime cannot run, LoadError for a missing tensor or a wrong shape (naming them). MXFP4 experts
    kept for the fused kernels are then re-laid for their table-free decode, FP8 ones holding a NaN
    refused (`RoutedExperts.pack_for_kernels`).
    """
    path = Path(path)
    spec = spec if spec is not None else read_draft_spec(path)
    model = DRAFT_FAMILIES[spec.kind](spec, dtype=dtype, device=device, dispatcher=dispatcher, kernels=kernels)
    # a quantized export (quantization_config) is dequantized to `dtype` as it is read
    with SafetensorsSource(draft_weight_map(path, spec)) as source:
        load_draft_weights(model, quantized_source(source, spec.ffn, dtype), origin=str(path))
    for name, module in model.named_modules():
        if isinstance(module, RoutedExperts):
            module.pack_for_kernels(name)
    return model.eval()


def _strip(name: str) -> str | None:
    """The export name without `model.`; None for tensors the draft never holds (the target's)."""
    name = name.removeprefix("model.")
    return None if name.startswith(SKIPPED_PREFIXES) else name


def load_draft_weights(model: DFlashDraft, source: TensorSource, *, origin: str = "checkpoint") -> None:
    """Copy every draft tensor of `source` into `model`; LoadError lists all missing tensors at once."""
    if model.spec.kind == "dspark_v4":  # SpecForge's DSparkV4DraftModel export keeps DeepSeek's `mtp.{i}.*` names
        source = DeepseekExportSource(source, model.spec.num_layers)
    params = {n: p for n, p in model.named_parameters() if not _FFN_NAME.match(n)}
    loaded: set[str] = set()
    unused: list[str] = []
    ffn_names: list[str] = []
    with torch.no_grad():
        for name in source.keys():
            own = _strip(name)
            if own is None:
                continue
            if _FFN_NAME.match(own):
                ffn_names.append(name)
                continue
            param = params.get(own)
            if param is None:
                unused.append(name)
                continue
            shape = tuple(source.shape(name))
            if shape != tuple(param.shape):
                raise LoadError(f"{origin}: {name}: expected shape {list(param.shape)}, found {list(shape)}")
            param.copy_(source.get(name))
            loaded.add(own)
    missing = [n for n in params if n not in loaded]
    consumed: set[str] = set()
    for i, layer in enumerate(model.layers):
        consumed |= layer.mlp.load_weights(source)
        try:
            layer.mlp.check_loaded()
        except LoadError as e:
            missing.append(str(e))
    unused += [n for n in ffn_names if n not in consumed]
    foreign_markov = sorted(n for n in unused if _strip(n).startswith("markov_head."))
    if foreign_markov:
        # A Markov tensor of another head type means the config names the wrong head: serving the
        # head it names would draft with a different model than the one trained.
        raise LoadError(f"{origin}: {', '.join(foreign_markov)}: no such tensor in a "
                        f"markov_head_type = {model.spec.markov_head_type!r} head (check the config)")
    if missing:
        raise LoadError(f"{origin}: partial export, {len(missing)} missing: {'; '.join(missing)}")
    if unused:
        log.warning("%s: %d tensor(s) not used by the draft: %s", origin, len(unused), ", ".join(sorted(unused)[:8]))


def to_specforge_state_dict(model: DFlashDraft) -> dict[str, torch.Tensor]:
    """The draft's tensors in SpecForge export naming (Qwen per-expert names for MoE layers).

    Inverse of `load_draft_weights` for a model holding every expert (ep = tp = 1): stacked
    `experts.w13 [E, 2I, H]` is written back as `experts.{i}.gate_proj / up_proj` and `w2` as
    `experts.{i}.down_proj`, the router as `gate.*`, the shared expert as `shared_expert.*` and its
    output gate as `shared_expert_gate.weight`.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if not _FFN_NAME.match(name):
            out[name] = tensor.detach().clone().contiguous()
    for i, layer in enumerate(model.layers):
        prefix = f"layers.{i}.mlp."
        shard = layer.mlp.expert_shard
        if shard is not None and (shard.ep_size > 1 or shard.tp_size > 1):
            raise ConfigError(f"layer {i}: export needs every expert on this rank (ep = tp = 1)")
        for name, tensor in layer.mlp.state_dict().items():
            t = tensor.detach()
            if name in ("experts.w13", "experts.w2"):
                for e in range(t.shape[0]):
                    if name == "experts.w2":
                        out[f"{prefix}experts.{e}.down_proj.weight"] = t[e].clone().contiguous()
                    else:
                        half = t.shape[1] // 2
                        out[f"{prefix}experts.{e}.gate_proj.weight"] = t[e, :half].clone().contiguous()
                        out[f"{prefix}experts.{e}.up_proj.weight"] = t[e, half:].clone().contiguous()
                continue
            if name.startswith("experts."):
                raise ConfigError(f"layer {i}: {name}: expert biases have no SpecForge export name")
            renamed = (
                name.replace("router.", "gate.", 1)
                .replace("shared.output_gate.", "shared_expert_gate.", 1)
                .replace("shared.", "shared_expert.", 1)
            )
            out[prefix + renamed] = t.clone().contiguous()
    return out
