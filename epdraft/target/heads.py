"""HFHeads: a target checkpoint's embedding and lm_head alone, for ranks that only run the draft.

A disaggregated draft rank reads the target only through `embed` and `lm_head` (the draft's
`TargetHeads`); loading the whole `AutoModelForCausalLM` there would cost the target's full weights
in memory and load time. This reads the two tensors from the HF checkpoint's safetensors and
computes exactly what `HFTarget.embed` / `HFTarget.lm_head` compute (a plain lookup, a bias-free
linear); models whose input embedding is scaled (Gemma) are not covered by it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from epdraft.config.hf import read_config_json
from epdraft.errors import ConfigError, LoadError
from epdraft.loading import SafetensorsSource, open_checkpoint

log = logging.getLogger(__name__)

EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
"""The input embedding's name: causal LMs, then multimodal wrappers (the text model under `model.language_model`)."""
LM_HEAD_NAME = "lm_head.weight"


class HFHeads:
    """The target's embedding [V, H] and lm_head [V, H] as `TargetHeads`, plus the config sizes
    `check_against_target` needs. With tied embeddings both are the same tensor."""

    def __init__(
        self, embed_VH: torch.Tensor, lm_head_VH: torch.Tensor, *, hidden_size: int, vocab_size: int, num_layers: int
    ):
        self.embed_weight = embed_VH
        self.lm_head_weight = lm_head_VH
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.num_layers = num_layers

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device="cpu") -> "HFHeads":
        """Read config.json and the two tensors of an HF model directory (single or sharded safetensors).

        Raises ConfigError naming config.json's missing key, LoadError naming a missing or misshapen tensor.
        """
        path = Path(path)
        config = read_config_json(path)
        text = config.get("text_config")
        text = text if isinstance(text, dict) else config
        hidden_size, vocab_size, num_layers = (
            _config_int(path, config, text, key) for key in ("hidden_size", "vocab_size", "num_hidden_layers")
        )
        tied = _tied(config, text)
        with open_checkpoint(path) as source:
            embed_name = next((n for n in EMBED_NAMES if n in source.keys()), None)
            if embed_name is None:
                raise LoadError(f"{path}: no embedding tensor (looked for {' or '.join(EMBED_NAMES)})")
            embed = _read(source, path, embed_name, hidden_size, dtype, device)
            if tied is None:
                # Absent from config.json: save_pretrained stores lm_head.weight only when it is not tied.
                tied = LM_HEAD_NAME not in source.keys()
            if tied:
                head = embed
            elif LM_HEAD_NAME in source.keys():
                head = _read(source, path, LM_HEAD_NAME, hidden_size, dtype, device)
            else:
                raise LoadError(f"{path}: no {LM_HEAD_NAME} tensor, and config.json says tie_word_embeddings = false")
        log.info("target heads from %s: %s, lm_head %s", path, embed_name, "tied" if tied else LM_HEAD_NAME)
        return cls(embed, head, hidden_size=hidden_size, vocab_size=vocab_size, num_layers=num_layers)

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] int64 -> embeddings [..., H]."""
        return F.embedding(ids.to(self.device), self.embed_weight)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V]."""
        return F.linear(hidden.to(self.lm_head_weight.dtype), self.lm_head_weight)


def _config_int(path: Path, config: dict, text: dict, key: str) -> int:
    """A size from the text config (multimodal wrappers), else the top level; ConfigError naming the key."""
    value = text.get(key, config.get(key))
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{path / 'config.json'}: {key} = {value!r}, expected a positive integer")
    return value


def _tied(config: dict, text: dict) -> bool | None:
    """tie_word_embeddings from the top level, else the text config; None when neither has it."""
    value = config.get("tie_word_embeddings", text.get("tie_word_embeddings"))
    return None if value is None else bool(value)


def _read(
    source: SafetensorsSource, path: Path, name: str, hidden_size: int, dtype: torch.dtype, device
) -> torch.Tensor:
    """One [V, H] tensor, cast and moved; LoadError naming it when it is not 2-D with H columns."""
    shape = source.shape(name)
    if len(shape) != 2 or shape[1] != hidden_size:
        raise LoadError(f"{path}: {name} has shape {list(shape)}, expected [vocab, {hidden_size}]")
    return source.get(name).to(dtype=dtype, device=device)
