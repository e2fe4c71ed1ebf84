"""Prompt files: ids, text through the target's tokenizer, and errors that name the line."""

import json
from pathlib import Path

import pytest

from epdraft.errors import ConfigError
from epdraft.target.prompts import load_tokenizer, read_prompts

ASSETS = Path(__file__).resolve().parents[2] / "epdraft" / "assets"


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


def test_the_tiny_targets_tokenizer_is_its_bytes():
    """Ids 0-255 are the UTF-8 bytes (non-ASCII too), 256-259 BOS, EOS, PAD, MASK; decoding gives the text back."""
    tok = load_tokenizer(ASSETS / "tiny-target", "test")
    assert tok.encode("abc") == [97, 98, 99] and tok.decode([97, 98, 99]) == "abc"
    text = "café → 世界 🙂\n\t"
    assert tok.encode(text) == list(text.encode()) and tok.decode(tok.encode(text)) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, len(tok)) == (256, 257, 258, 260)
    assert tok.decode([256, 104, 105, 257], skip_special_tokens=True) == "hi"


def test_the_shipped_prompts_text_is_their_input_ids(tmp_path):
    """Every line's `text`, read as a text prompt through the tiny target's tokenizer, is its `input_ids`."""
    lines = [json.loads(line) for line in (ASSETS / "prompts.jsonl").read_text().splitlines()]
    texts = _write(tmp_path, [json.dumps({"text": line["text"]}) for line in lines])
    assert read_prompts(texts, tokenizer_dir=ASSETS / "tiny-target") == [line["input_ids"] for line in lines]
    assert len(lines) == 32


@pytest.mark.parametrize(
    "line,message",
    [
        ("{not json", r"prompts.jsonl:1: not JSON"),
        (json.dumps({"ids": [1]}), r"prompts.jsonl:1: expected a JSON object with 'input_ids'"),
        (json.dumps({"input_ids": "1 2"}), r"prompts.jsonl:1: input_ids must be a list of token ids, got str"),
        (json.dumps({"text": "hi"}), r"prompts.jsonl:1: has 'text' but no tokenizer could be loaded"),
        (json.dumps({"text": 7}), r"prompts.jsonl:1: text must be a string, got int"),
        (json.dumps({"input_ids": [1, True]}), r"prompts.jsonl:1: input_ids\[1\] = true is not a token id"),
        (json.dumps({"input_ids": [1.5]}), r"prompts.jsonl:1: input_ids\[0\] = 1.5 is not a token id"),
    ],
)
def test_bad_lines_are_named(tmp_path, line, message):
    with pytest.raises(ConfigError, match=message):
        read_prompts(_write(tmp_path, [line]), tokenizer_dir=tmp_path / "no-such-target")


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"--prompts .*missing.jsonl: cannot read"):
        read_prompts(tmp_path / "missing.jsonl")


def test_non_utf8_file_names_the_line(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_bytes(b'{"input_ids": [1]}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match=r"prompts.jsonl:2: not UTF-8 \(byte 0xe9\)"):
        read_prompts(p)


def test_a_directory_without_tokenizer_files_is_refused_before_transformers(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    p = _write(tmp_path, [json.dumps({"text": "hello"})])
    with pytest.raises(ConfigError, match=r"prompts.jsonl:1: has 'text' but no tokenizer .*none of tokenizer.json"):
        read_prompts(p, tokenizer_dir=tmp_path / "target")


def test_a_lines_sampling_overrides_the_runs_defaults_field_by_field(tmp_path):
    from epdraft.config.sampling import SamplingParams
    from epdraft.target.prompts import Prompt, read_prompt_file

    lines = [
        json.dumps({"input_ids": [1], "id": "a"}),
        "",
        json.dumps({"input_ids": [2], "temperature": 0.7, "top_k": None, "seed": 5, "id": 7}),
        json.dumps({"input_ids": [3], "top_p": 1}),
    ]
    defaults = SamplingParams(temperature=0.5, top_k=4, top_p=0.9)
    prompts = read_prompt_file(_write(tmp_path, lines), defaults=defaults)
    assert prompts == [
        Prompt(line=1, ids=[1], sampling=defaults, id="a"),
        Prompt(line=3, ids=[2], sampling=SamplingParams(temperature=0.7, top_k=None, top_p=0.9, seed=5), id=7),
        Prompt(line=4, ids=[3], sampling=SamplingParams(temperature=0.5, top_k=4, top_p=1.0)),
    ]
    assert read_prompt_file(_write(tmp_path, lines), limit=1)[0].sampling == SamplingParams()


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"temperature": -0.5}, r"prompts.jsonl:2: temperature = -0.5: expected `float` >= 0.0"),
        ({"temperature": True}, r"prompts.jsonl:2: temperature = True: expected `float`, got `bool`"),
        ({"temperature": "0.7"}, r"prompts.jsonl:2: temperature = '0.7': expected `float`, got `str`"),
        ({"top_p": 1.5}, r"prompts.jsonl:2: top_p = 1.5: expected `float` <= 1.0"),
        ({"top_p": 0}, r"prompts.jsonl:2: top_p = 0: expected `float` > 0.0"),
        ({"top_k": 0}, r"prompts.jsonl:2: top_k = 0: expected `int` >= 1"),
        ({"top_k": 2.5}, r"prompts.jsonl:2: top_k = 2.5: expected `int | null`, got `float`"),
        ({"seed": 1.0}, r"prompts.jsonl:2: seed = 1.0: expected `int | null`, got `float`"),
        ({"seed": -1}, r"prompts.jsonl:2: seed = -1: expected `int` >= 0"),
        ({"seed": 2**63}, r"prompts.jsonl:2: seed = 9223372036854775808: expected `int` <= 9223372036854775807"),
        ({"id": [1]}, r"prompts.jsonl:2: id must be a JSON scalar \(string, number, true/false or null\), got list"),
    ],
)
def test_bad_sampling_fields_are_refused_naming_the_line_and_field(tmp_path, fields, message):
    from epdraft.target.prompts import read_prompt_file

    p = _write(tmp_path, [json.dumps({"input_ids": [1]}), json.dumps({"input_ids": [2], **fields})])
    with pytest.raises(ConfigError, match=message):
        read_prompt_file(p)
    with pytest.raises(ConfigError, match=message):  # callers that only need ids read the file as strictly
        read_prompts(p)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused(tmp_path, constant):
    p = _write(tmp_path, ['{"input_ids": [1], "temperature": %s}' % constant])
    with pytest.raises(ConfigError, match=rf"prompts.jsonl:1: {constant} is not JSON, expected finite numbers"):
        read_prompts(p)
