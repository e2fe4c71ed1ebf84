"""Prompt files: JSON lines, each `{"input_ids": [...]}` or `{"text": "..."}` (through the target's
tokenizer), optionally with the request's sampling (`temperature`, `top_k`, `top_p`, `seed`) and an `id`.

Read strictly, naming the file and line of the first fault: the launcher reads the file once before
any rank starts (`epdraft.preflight`), and every rank reads it again the same way. What is wrong
with the file (encoding, JSON, types) is a ConfigError; what is wrong with one request (an empty
prompt, an id outside the vocabulary) is left to the target, which refuses that request only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from epdraft.config.sampling import SamplingParams, parse_sampling
from epdraft.errors import ConfigError

# What `AutoTokenizer.from_pretrained` needs one of; without any it returns an empty tokenizer that
# turns every text into [] (every request then refused as empty).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed")


class Prompt(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt of the file: its line (for messages), token ids, sampling (the run's defaults with
    the line's own fields over them) and the line's `id` (any JSON scalar, echoed in the output file;
    None when the line has none)."""

    line: int
    ids: list[int]
    sampling: SamplingParams
    id: str | int | float | bool | None = None


def read_prompt_file(
    path: str | Path,
    *,
    defaults: SamplingParams = SamplingParams(),
    limit: int = 0,
    tokenizer_dir: str | Path | None = None,
) -> list[Prompt]:
    """The prompts of a JSON-lines file (the first `limit`, all when 0), one per non-blank line.

    `input_ids` wins when a line has both keys; `text` is tokenized (no special tokens) with the
    tokenizer saved in `tokenizer_dir`. A line's `temperature` / `top_k` / `top_p` / `seed`
    override `defaults` (the run's flags) field by field; `id` is kept for the output file. Raises
    ConfigError naming `path:line` for a line that is not a JSON object with `input_ids` (a list of
    integers; `true` is not one) or `text` (a string), with a sampling field out of its range or of
    the wrong type (nothing is clamped), NaN or Infinity anywhere, or an `id` that is not a JSON
    scalar; and naming the file when it cannot be read or is not UTF-8.
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
    base = msgspec.structs.asdict(defaults)
    tokenizer = None
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        record = _json_object(line, where)
        if "input_ids" in record:
            ids = _token_ids(record["input_ids"], where)
        else:
            if not isinstance(record["text"], str):
                raise ConfigError(f"{where}: text must be a string, got {type(record['text']).__name__}")
            if tokenizer is None:
                tokenizer = load_tokenizer(tokenizer_dir, where)
            ids = tokenizer(record["text"], add_special_tokens=False)["input_ids"]
        own = {key: record[key] for key in SAMPLING_FIELDS if key in record}
        sampling = parse_sampling({**base, **own}, where) if own else defaults
        prompt_id = record.get("id")
        if not isinstance(prompt_id, (str, int, float, bool, type(None))):
            raise ConfigError(f"{where}: id must be a JSON scalar (string, number, true/false or null), "
                              f"got {type(prompt_id).__name__}")  # fmt: skip
        prompts.append(Prompt(line=n, ids=ids, sampling=sampling, id=prompt_id))
    return prompts[:limit] if limit else prompts


def read_prompts(path: str | Path, limit: int = 0, *, tokenizer_dir: str | Path | None = None) -> list[list[int]]:
    """Token ids per prompt (the first `limit`, all when 0), for callers that need no more; see
    `read_prompt_file` (the file is checked the same way, sampling fields included)."""
    return [p.ids for p in read_prompt_file(path, limit=limit, tokenizer_dir=tokenizer_dir)]


def _json_object(line: str, where: str) -> dict:
    """One line as a JSON object with `input_ids` or `text`. NaN and Infinity, which Python's json
    reads but JSON does not have, are refused: a temperature of Infinity is no setting."""

    def refuse(constant: str):
        raise ConfigError(f"{where}: {constant} is not JSON, expected finite numbers")

    try:
        record = json.loads(line, parse_constant=refuse)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not JSON ({e.msg})") from e
    if not isinstance(record, dict) or not ("input_ids" in record or "text" in record):
        raise ConfigError(f"{where}: expected a JSON object with 'input_ids' (a list of ids) or 'text'")
    return record


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


def saved_tokenizer(directory: str | Path, where: str):
    """The tokenizer saved in `directory` when it has one, else None: outputs of a target saved
    without one are shown as token ids, nothing is guessed."""
    if not any((Path(directory) / f).is_file() for f in TOKENIZER_FILES):
        return None
    return load_tokenizer(directory, where)
