"""Prompt files: JSON lines, each `{"input_ids": [...]}` or `{"text": "..."}` (through the target's tokenizer).

Read strictly, naming the file and line of the first fault: the launcher reads the file once before
any rank starts (`epdraft.preflight`), and every rank reads it again the same way. What is wrong
with the file (encoding, JSON, types) is a ConfigError; what is wrong with one request (an empty
prompt, an id outside the vocabulary) is left to the target, which refuses that request only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from epdraft.errors import ConfigError

# What `AutoTokenizer.from_pretrained` needs one of; without any it returns an empty tokenizer that
# turns every text into [] (every request then refused as empty).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def read_prompt_lines(path: str | Path, *, tokenizer_dir: str | Path | None = None) -> list[tuple[int, list[int]]]:
    """(line number, token ids) per non-blank line of a JSON-lines prompt file.

    `input_ids` wins when a line has both keys; `text` is tokenized (no special tokens) with the
    tokenizer saved in `tokenizer_dir`. Raises ConfigError naming `path:line` for a line that is
    not a JSON object with `input_ids` (a list of integers; `true` is not one) or `text` (a string),
    and naming the file when it cannot be read or is not UTF-8.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"--prompts {path}: cannot read: {e.strerror}") from e
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 (byte {data[e.start]:#04x}), expected UTF-8 JSON lines") from None
    tokenizer = None
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n}: not JSON ({e.msg})") from e
        if not isinstance(record, dict) or not ("input_ids" in record or "text" in record):
            raise ConfigError(f"{path}:{n}: expected a JSON object with 'input_ids' (a list of ids) or 'text'")
        if "input_ids" in record:
            ids = _token_ids(record["input_ids"], f"{path}:{n}")
        else:
            if not isinstance(record["text"], str):
                raise ConfigError(f"{path}:{n}: text must be a string, got {type(record['text']).__name__}")
            if tokenizer is None:
                tokenizer = load_tokenizer(tokenizer_dir, f"{path}:{n}")
            ids = tokenizer(record["text"], add_special_tokens=False)["input_ids"]
        prompts.append((n, ids))
    return prompts


def read_prompts(path: str | Path, limit: int = 0, *, tokenizer_dir: str | Path | None = None) -> list[list[int]]:
    """Token ids per prompt (the first `limit`, all when 0); see `read_prompt_lines`."""
    prompts = [ids for _, ids in read_prompt_lines(path, tokenizer_dir=tokenizer_dir)]
    return prompts[:limit] if limit else prompts


def _token_ids(ids: Any, where: str) -> list[int]:
    if not isinstance(ids, list):
        raise ConfigError(f"{where}: input_ids must be a list of token ids, got {type(ids).__name__}")
    for i, t in enumerate(ids):
        # bool is an int subclass in Python: `true` would silently become token 1.
        if not isinstance(t, int) or isinstance(t, bool):
            raise ConfigError(f"{where}: input_ids[{i}] = {json.dumps(t)} is not a token id, expected an integer")
    return ids


def load_tokenizer(directory: str | Path | None, where: str):
    """The HF tokenizer saved in `directory` (the target's), local files only; ConfigError naming `where`
    when there is none."""
    found = directory is not None and any((Path(directory) / f).is_file() for f in TOKENIZER_FILES)
    if not found:
        raise ConfigError(
            f"{where}: has 'text' but no tokenizer could be loaded from {directory} (none of "
            f"{', '.join(TOKENIZER_FILES)}); give 'input_ids' instead, or save the tokenizer with the target"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: has 'text' but the tokenizer in {directory} cannot be loaded: {e}") from e
