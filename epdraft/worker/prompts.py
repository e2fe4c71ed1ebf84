"""The prompts file of `epdraft run`: JSON lines, token ids or text for the target's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from epdraft.errors import ConfigError


def read_prompts(path: str | Path, limit: int = 0, *, tokenizer_dir: str | Path | None = None) -> list[list[int]]:
    """Token ids per prompt from a JSON-lines file: each line {"input_ids": [...]} or {"text": "..."}.

    `text` is tokenized with the tokenizer saved in `tokenizer_dir` (the target's directory); a line
    that is not JSON, has neither key, or has text when there is no tokenizer is a ConfigError
    naming the file and line. Ids are checked against the target's vocabulary per request later,
    so one bad prompt does not stop the others.
    """
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"--prompts {path}: cannot read: {e.strerror}") from e
    tokenizer = None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n}: not JSON ({e.msg})") from e
        if not isinstance(record, dict) or not ("input_ids" in record or "text" in record):
            raise ConfigError(f"{path}:{n}: expected a JSON object with 'input_ids' (a list of ids) or 'text'")
        if "input_ids" in record:
            ids = record["input_ids"]
            if not isinstance(ids, list):
                raise ConfigError(f"{path}:{n}: input_ids must be a list of token ids, got {type(ids).__name__}")
        else:
            if tokenizer is None:
                tokenizer = _load_tokenizer(tokenizer_dir, f"{path}:{n}")
            ids = tokenizer(record["text"], add_special_tokens=False)["input_ids"]
        prompts.append(ids)
    return prompts[:limit] if limit else prompts


def _load_tokenizer(directory: str | Path | None, where: str):
    """The HF tokenizer saved with the target; ConfigError naming the prompt line when there is none."""
    from transformers import AutoTokenizer

    try:
        if directory is None:
            raise OSError("no target directory")
        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{where}: has 'text' but no tokenizer could be loaded from {directory} ({e}); give 'input_ids' instead"
        ) from e
