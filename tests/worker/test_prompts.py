"""Prompt files: ids, text through the target's tokenizer, and errors that name the line."""

import json

import pytest

from epdraft.errors import ConfigError
from epdraft.worker.prompts import read_prompts


def _write(tmp_path, lines):
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_ids_are_read_in_order_and_limited(tmp_path):
    p = _write(tmp_path, [json.dumps({"input_ids": [1, 2]}), "", json.dumps({"input_ids": [3], "text": "ignored"})])
    assert read_prompts(p) == [[1, 2], [3]]
    assert read_prompts(p, 1) == [[1, 2]]


def test_text_goes_through_the_targets_tokenizer(tmp_path):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "target")
    p = _write(tmp_path, [json.dumps({"text": "hello world hello"})])
    assert read_prompts(p, tokenizer_dir=tmp_path / "target") == [[1, 2, 1]]


@pytest.mark.parametrize(
    "line,message",
    [
        ("{not json", r"prompts.jsonl:1: not JSON"),
        (json.dumps({"ids": [1]}), r"prompts.jsonl:1: expected a JSON object with 'input_ids'"),
        (json.dumps({"input_ids": "1 2"}), r"prompts.jsonl:1: input_ids must be a list of token ids, got str"),
        (json.dumps({"text": "hi"}), r"prompts.jsonl:1: has 'text' but no tokenizer could be loaded"),
    ],
)
def test_bad_lines_are_named(tmp_path, line, message):
    with pytest.raises(ConfigError, match=message):
        read_prompts(_write(tmp_path, [line]), tokenizer_dir=tmp_path / "no-such-target")


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"--prompts .*missing.jsonl: cannot read"):
        read_prompts(tmp_path / "missing.jsonl")
