"""`epdraft run`'s checks before any rank starts: everything a rank would read, read once, here.

A bad draft, target, prompt file or flag found inside the ranks is found seconds later, once per
rank, under torchrun's traceback. Here it is one line naming the file, key, line or tensor, and
exit 2, before torchrun runs. What is checked:

- the runner's extra: transformers (`epdraft[hf]`) is installed;
- flags: --max-new-tokens >= 1, --max-prompts >= 0, --json's and --output's folders exist and are
  writable; the sampling flags (--temperature >= 0 and finite, --top-k >= 1, --top-p in (0, 1],
  --seed in [0, 2**63));
- the draft: its config.json as `epdraft check` and the ranks parse it, and every safetensors
  header (names, shapes, dtypes, truncation) through a load onto the meta device, which reads no
  weight; its weights' values are finite (read once, when the draft is under `WEIGHT_CHECK_BYTES`
  or with --check-weights);
- the target: a local directory (never a hub id) with a config.json, not the draft; its
  embedding's shape against vocab_size and hidden_size, its files' headers; a tokenizer when a
  prompt has text;
- the draft against the target and the layout (what the ranks check before step 0);
- the prompts: UTF-8 JSON lines of integer ids or text, not all refused, each within the
  target's max_position_embeddings with --max-new-tokens, each line's sampling fields in range;
  under disaggregated placement, greedy only (its link carries no proposal probabilities);
- the layout: target.tp = 1 (the runner loads the whole HF target on every target rank; a
  tensor-parallel target is not implemented, and a config asking for one is refused, naming it);
- the transport: `placement.transfer = 'mooncake'` imports Mooncake's engine here (its wheel and the
  system library it links, libibverbs).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import math
import os
from pathlib import Path
from epdraft.config.hf import parse_ffn_config, read_config_json
from epdraft.config.parallel import ParallelConfig, check_moe_split, check_standalone_target
from epdraft.config.sampling import SamplingParams
from epdraft.errors import ConfigError, LoadError, RequestError
from epdraft.loading.header import FLOAT_DTYPES

# What a draft export may store: float weights and FP8 / MXFP4 quantized experts (F8 values, U8
# blocks and e8m0 scales); integers only in a hash layer's token table. The loader checks each
# tensor's place and shape; this refuses what no such tensor can be.
DRAFT_DTYPES = (*FLOAT_DTYPES, "F8_E4M3", "F8_E5M2", "F8_E8M0", "U8", "I8")
"""Float weights, FP8 values, e8m0 scales, MXFP4 blocks (U8) and DeepSeek's packed FP4 experts (I8)."""
TOKEN_TABLE_DTYPES = ("I64", "I32")
from epdraft.loading.quantized import quantized_source
from epdraft.loading.source import HeaderSource, checkpoint_weight_map
from epdraft.models.spec import DraftModelSpec, check_against_target
from epdraft.target.base import validate_prompt
from epdraft.target.prompts import Prompt, read_prompt_file

log = logging.getLogger(__name__)

WEIGHT_CHECK_BYTES = 4 << 30  # reading this much once costs seconds; bigger drafts need --check-weights
_EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")


@dataclasses.dataclass(frozen=True)
class TargetFacts:
    """What the ranks will read from the target's config.json."""

    path: Path
    hidden_size: int
    num_layers: int
    vocab_size: int
    max_positions: int | None


def check_run(args: argparse.Namespace, pc: ParallelConfig) -> None:
    """Every check above, in the order a user fixes things; raises ConfigError / LoadError on the first fault."""
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError("the standalone runner's target runs on transformers, which is not installed: "
                          "pip install 'epdraft[hf]'")  # fmt: skip
    check_run_flags(args)
    check_standalone_target(pc, source=args.config)
    check_transport(pc)
    spec, weight_map = check_draft(args.draft)
    target = check_target(args.target, draft=args.draft)
    try:
        check_against_target(
            spec, hidden_size=target.hidden_size, num_layers=target.num_layers, vocab_size=target.vocab_size
        )
    except ConfigError as e:
        raise ConfigError(f"--draft {args.draft} on --target {args.target}: {e}") from None
    check_moe_split(pc, spec.ffn, source=str(Path(args.draft) / "config.json"))
    defaults = flag_sampling(args)
    prompts = check_prompts(args.prompts, target, defaults=defaults, max_new_tokens=args.max_new_tokens,
                            max_prompts=args.max_prompts)  # fmt: skip
    if pc.placement.mode == "disaggregated":
        from epdraft.worker.disagg_job import refuse_sampled

        refuse_sampled(defaults, prompts, args.prompts)
    if args.check_weights or (args.check_weights is None and _total_bytes(weight_map) <= WEIGHT_CHECK_BYTES):
        check_finite(weight_map)
    elif args.check_weights is None:
        log.info("draft weights not checked for NaN/inf (over %d GiB; --check-weights reads them)",
                 WEIGHT_CHECK_BYTES >> 30)  # fmt: skip


def check_transport(pc: ParallelConfig) -> None:
    """Raise ConfigError naming placement.transfer when its transport cannot load here (Mooncake
    installed without the system library it links fails only at import, in every rank otherwise)."""
    if pc.placement.mode == "disaggregated" and pc.placement.transfer == "mooncake":
        from epdraft.worker.transfer.mooncake import unavailable_reason

        if (why := unavailable_reason()) is not None:
            raise ConfigError(f"placement.{why}")


def check_run_flags(args: argparse.Namespace) -> None:
    """The numeric flags and the --json / --output destinations (a result found unwritable after
    the run is lost)."""
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: expected an integer >= 1")
    if args.max_prompts < 0:
        raise ConfigError(f"--max-prompts {args.max_prompts}: expected an integer >= 0 (0 = every prompt)")
    if args.show < 0:
        raise ConfigError(f"--show {args.show}: expected an integer >= 0 (requests whose text is printed)")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(f"--temperature {args.temperature}: expected a finite number >= 0 (0 = greedy)")
    if args.top_k is not None and args.top_k < 1:
        raise ConfigError(f"--top-k {args.top_k}: expected an integer >= 1 (leave it out to keep every token)")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p {args.top_p}: expected a number in (0, 1] (1 = keep every token)")
    if not 0 <= args.seed < 2**63:
        raise ConfigError(f"--seed {args.seed}: expected an integer in [0, 2**63)")
    for flag, path in (("--json", args.json), ("--output", args.output)):
        if path:
            _check_writable(flag, Path(path))


def _check_writable(flag: str, out: Path) -> None:
    folder = out.resolve().parent
    if out.is_dir():
        raise ConfigError(f"{flag} {out}: is a directory, expected a file path")
    if not folder.is_dir():
        raise ConfigError(f"{flag} {out}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ConfigError(f"{flag} {out}: not writable")


def flag_sampling(args: argparse.Namespace) -> SamplingParams:
    """Every prompt's default sampling, from the flags `check_run_flags` checked (no seed: --seed
    is the run's, each prompt's own derives from it)."""
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def check_draft(path: str | Path) -> tuple[DraftModelSpec, dict[str, Path]]:
    """The draft's spec and weight map, after a meta-device load that checks every tensor's name and shape."""
    import torch

    from epdraft.models.checkpoint import draft_weight_map, load_draft_weights
    from epdraft.models.protocol import DRAFT_FAMILIES

    directory = _local_dir(path, "--draft")
    config_file = directory / "config.json"
    config = read_config_json(directory)
    try:
        parse_ffn_config(config)  # what `epdraft check` reports, with the same message
    except ConfigError as e:
        raise ConfigError(f"{config_file}: {e}") from None
    spec = DraftModelSpec.from_config(config, source=str(config_file))
    weight_map = draft_weight_map(directory, spec)  # a draft bundled in its target's checkpoint: its own tensors
    source = HeaderSource(weight_map)
    for name, t in source.tensors.items():
        allowed = TOKEN_TABLE_DTYPES if name.endswith(".tid2eid") else DRAFT_DTYPES
        if t.dtype not in allowed:
            raise LoadError(f"{weight_map[name]}: {name}: dtype {t.dtype}, expected one of {', '.join(allowed)}")
    # The meta model only checks names and shapes: the load-time facts it would log (how quantized
    # experts are stored) are the ranks' to say, on their own device.
    storage_log = logging.getLogger("epdraft.layers.routed_experts")
    level = storage_log.level
    storage_log.setLevel(logging.WARNING)
    try:
        model = DRAFT_FAMILIES[spec.kind](spec, dtype=torch.float32, device="meta", dispatcher=None)
        load_draft_weights(model, quantized_source(source, spec.ffn, torch.float32), origin=str(directory))
    finally:
        storage_log.setLevel(level)
    return spec, weight_map


def check_finite(weight_map: dict[str, Path]) -> None:
    """Raise LoadError naming the first tensor holding NaN or inf: such a draft proposes garbage that
    the target rejects every step (lossless, yet accept length 1.0), which looks like a bad draft."""
    import torch
    from safetensors import safe_open

    for file in sorted(set(weight_map.values())):
        with safe_open(str(file), framework="pt") as f:
            for name in sorted(n for n, path in weight_map.items() if path == file):  # the draft's (not a target's)
                tensor = f.get_tensor(name)
                if not tensor.dtype.is_floating_point:  # token tables, MXFP4 blocks, packed FP4, uint8 e8m0 scales
                    continue
                if tensor.element_size() == 1:  # FP8: torch has no isfinite for it
                    tensor = tensor.float()
                bad = int((~torch.isfinite(tensor)).sum())
                if bad:
                    raise LoadError(
                        f"{file}: {name}: {bad} of {tensor.numel()} values are NaN or inf, expected finite weights"
                    )


def check_target(path: str | Path, *, draft: str | Path) -> TargetFacts:
    """The target's geometry from its config.json, checked against its weights' headers."""
    directory = _local_dir(path, "--target")
    if directory.resolve() == Path(draft).resolve():
        raise ConfigError(f"--target {path}: is the --draft directory, expected the target model's HF directory")
    config_file = directory / "config.json"
    config = read_config_json(directory)
    if "dflash_config" in config:
        raise ConfigError(
            f"--target {path}: {config_file} has dflash_config: a draft export, expected the target model"
        )
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    values = {key: config.get(key, text.get(key)) for key in ("hidden_size", "num_hidden_layers", "vocab_size")}
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{config_file}: {key} = {value!r}, expected a positive integer")
    max_positions = config.get("max_position_embeddings", text.get("max_position_embeddings"))
    facts = TargetFacts(
        path=directory,
        hidden_size=values["hidden_size"],
        num_layers=values["num_hidden_layers"],
        vocab_size=values["vocab_size"],
        max_positions=max_positions if isinstance(max_positions, int) and max_positions > 0 else None,
    )
    _check_target_weights(facts, config_file)
    return facts


def _check_target_weights(target: TargetFacts, config_file: Path) -> None:
    """Headers of every safetensors file (truncation), and the embedding's [vocab_size, hidden_size]."""
    if not any(target.path.glob("*.safetensors")) and any(target.path.glob("*.bin")):
        log.info("%s: PyTorch .bin weights; transformers checks their shapes when the ranks load them", target.path)
        return
    weight_map = checkpoint_weight_map(target.path)
    source = HeaderSource(weight_map)
    expected = (target.vocab_size, target.hidden_size)
    for name, t in source.tensors.items():
        if name.endswith(_EMBEDDING_SUFFIXES) or name == "lm_head.weight":
            if t.shape != expected:
                raise LoadError(
                    f"{weight_map[name]}: {name} has shape {list(t.shape)}, but {config_file} says vocab_size = "
                    f"{target.vocab_size}, hidden_size = {target.hidden_size}: expected {list(expected)}"
                )


def check_prompts(
    path: str | Path, target: TargetFacts, *, defaults: SamplingParams, max_new_tokens: int, max_prompts: int
) -> list[Prompt]:
    """The prompts as the ranks will read them (the flags' sampling under each line's own): refused
    when none is left to serve, or one is too long; returns them.

    A prompt the target would refuse (empty, id outside the vocabulary) is only warned about here:
    the run serves the others and lists it with its reason.
    """
    lines = read_prompt_file(path, defaults=defaults, limit=max_prompts, tokenizer_dir=target.path)
    if not lines:
        raise ConfigError(f"--prompts {path}: no prompts, expected one JSON object per line")
    refused = []
    for rid, prompt in enumerate(lines):
        n, ids = prompt.line, prompt.ids
        try:
            validate_prompt(rid, ids, target.vocab_size)
        except RequestError as e:
            refused.append(f"{path}:{n}: {e}")
            continue
        if target.max_positions is not None and len(ids) + max_new_tokens > target.max_positions:
            raise ConfigError(
                f"{path}:{n}: {len(ids)} prompt tokens + --max-new-tokens {max_new_tokens} = "
                f"{len(ids) + max_new_tokens} positions, over the target's max_position_embeddings = "
                f"{target.max_positions}; expected at most {target.max_positions}"
            )
    if len(refused) == len(lines):
        raise ConfigError(
            f"--prompts {path}: all {len(lines)} prompts would be refused ({refused[0]}), "
            "expected at least one to serve"
        )
    if refused:
        log.warning("%d of %d prompts will be refused, the others run: %s",
                    len(refused), len(lines), "; ".join(refused[:3]))  # fmt: skip
    return lines


def _local_dir(path: str | Path, flag: str) -> Path:
    """`path` as an existing local directory; never resolved as a hub id (a typo would download or hang)."""
    directory = Path(path)
    if not directory.exists():
        raise ConfigError(f"{flag} {path}: no such directory (a local model directory is expected, never a hub id)")
    if not directory.is_dir():
        raise ConfigError(f"{flag} {path}: not a directory, expected a model directory with config.json")
    return directory


def _total_bytes(weight_map: dict[str, Path]) -> int:
    return sum(Path(f).stat().st_size for f in set(weight_map.values()))
