"""`--output`: one line per prompt in the prompts file's order, ids echoed, refused prompts with their error."""

from __future__ import annotations

import json

from epdraft.config.sampling import SamplingParams
from epdraft.target.prompts import Prompt
from epdraft.worker.output import write_outputs
from epdraft.worker.summary import RequestOutcome


def test_every_prompt_in_file_order_with_its_id_sampling_and_error(tmp_path):
    hot = SamplingParams(temperature=0.8, top_k=4, seed=99)
    greedy = SamplingParams(seed=12)
    prompts = [
        Prompt(line=1, ids=[1, 2], sampling=hot, id="first"),
        Prompt(line=2, ids=[], sampling=greedy),
        Prompt(line=4, ids=[3], sampling=greedy, id=7),
    ]
    outcomes = [  # as gathered: any order, from any rank
        RequestOutcome(request_id=2, rank=1, sampling=greedy, tokens=[5, 6, 7], accept_lens=[1, 0]),
        RequestOutcome(request_id=0, rank=0, sampling=hot, tokens=[8, 9, 10], accept_lens=[2]),
        RequestOutcome(request_id=1, rank=1, sampling=greedy, error="request 1: empty prompt"),
    ]
    out = tmp_path / "out.jsonl"
    write_outputs(out, prompts, outcomes, tokenizer_dir=tmp_path)  # no tokenizer there: text is null
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == [
        {"id": "first", "index": 0, "output_ids": [8, 9, 10], "text": None, "verify_steps": 1, "accepted_drafts": 2,
         "temperature": 0.8, "top_k": 4, "top_p": 1.0, "seed": 99},
        {"id": None, "index": 1, "output_ids": [], "text": None, "verify_steps": 0, "accepted_drafts": 0,
         "temperature": 0.0, "top_k": None, "top_p": 1.0, "seed": 12, "error": "request 1: empty prompt"},
        {"id": 7, "index": 2, "output_ids": [5, 6, 7], "text": None, "verify_steps": 2, "accepted_drafts": 1,
         "temperature": 0.0, "top_k": None, "top_p": 1.0, "seed": 12},
    ]  # fmt: skip


def test_text_is_decoded_with_the_targets_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "target")
    prompts = [Prompt(line=1, ids=[1], sampling=SamplingParams(seed=1))]
    outcomes = [RequestOutcome(request_id=0, rank=0, tokens=[1, 2], accept_lens=[1])]
    write_outputs(tmp_path / "out.jsonl", prompts, outcomes, tokenizer_dir=tmp_path / "target")
    assert json.loads((tmp_path / "out.jsonl").read_text())["text"] == "hello world"
