"""The run summary: acceptance arithmetic, phase split, and the lossless verdict with its first mismatch."""

from epdraft.worker.serve import assign_prompts
from epdraft.worker.summary import RankReport, RequestOutcome, format_summary, generations, summarize


def _report(rank, requests, seconds=2.0, layout="alltoall"):
    phases = {"verify": 0.5, "sync": 0.1, "draft_propose": 0.9, "moe_total": 0.6, "moe_dispatch": 0.2, "moe_combine": 0.1}
    return RankReport(rank=rank, steps=4, loop_seconds=seconds, phases=phases, requests=requests, layout=layout)


def test_summary_counts_the_bonus_and_splits_phases():
    ok = RequestOutcome(request_id=0, rank=0, tokens=[1, 2, 3, 4, 5, 6], accept_lens=[3, 1], reference_tokens=[1, 2, 3, 4, 5, 6])
    bad = RequestOutcome(request_id=1, rank=1, error="request 1: empty prompt")
    s = summarize([_report(0, [ok]), _report(1, [bad], seconds=3.0)], config="c.toml")
    assert s.accept_length == 3.0 and s.accepted_drafts_per_step == 2.0
    assert s.accept_length_per_rank == {0: 3.0, 1: 0.0}
    assert s.generated_tokens == 6 and s.tokens_per_s == 2.0  # the slowest rank's loop time
    assert s.failed_requests == {1: "request 1: empty prompt"}
    assert abs(s.phase_seconds["draft_attention"] - 0.3) < 1e-9  # propose - MoE total
    assert abs(s.phase_seconds["moe_experts"] - 0.3) < 1e-9  # MoE total - dispatch - combine
    assert s.lossless is True
    assert "lossless: OK" in format_summary(s)


def test_summary_names_the_first_differing_position():
    a = RequestOutcome(request_id=3, rank=1, tokens=[5, 6, 7, 8], accept_lens=[1, 1], reference_tokens=[5, 6, 9, 8])
    s = summarize([_report(0, [], layout=""), _report(1, [a], layout="gather (max_len)")], config="c.toml")
    assert s.layout == "gather (max_len)"  # the label a rank reports; a rank without one has none
    assert s.lossless is False
    assert "lossless: FAIL: request 3 (rank 1) differs at generated position 2" in format_summary(s)


def test_lossless_is_unknown_when_not_checked():
    a = RequestOutcome(request_id=0, rank=0, tokens=[1, 2], accept_lens=[1])
    assert summarize([_report(0, [a])], config="c").lossless is None


def test_show_prints_the_first_requests_text_or_their_ids_without_a_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "target")
    reports = [
        _report(0, [RequestOutcome(request_id=2, rank=0, tokens=[2, 1], accept_lens=[1])]),
        _report(1, [RequestOutcome(request_id=0, rank=1, tokens=[1, 2], accept_lens=[1]),
                    RequestOutcome(request_id=1, rank=1, error="request 1: empty prompt")]),
    ]  # fmt: skip
    s = summarize(reports, config="c")
    s.shown = generations(reports, 2, tokenizer_dir=tmp_path / "target")
    text = format_summary(s)
    assert "request 0 (rank 1): 'hello world'" in text and "request 1 (rank 1): refused" in text
    assert "request 2" not in text
    s.shown = generations(reports, 1, tokenizer_dir=tmp_path)  # no tokenizer files: ids, nothing guessed
    assert format_summary(s).endswith("request 0 (rank 1), token ids (the target has no tokenizer): [1, 2]")


def test_assign_prompts_balances_load_unevenly_and_deterministically():
    lens = [64, 10, 10, 10, 10, 30]
    split = assign_prompts(lens, 16, 4)
    assert sorted(i for r in split for i in r) == list(range(6))
    assert split == assign_prompts(lens, 16, 4)
    assert split[0] == [0]  # the longest prompt gets a rank of its own
    assert sorted(len(r) for r in split) == [1, 1, 2, 2]
    assert assign_prompts([5, 5], 8, 4)[2:] == [[], []]  # more ranks than prompts: idle ranks
