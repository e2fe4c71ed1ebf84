"""The run summary: acceptance arithmetic, phase split, and the lossless verdict with its first mismatch."""

import msgspec

from epdraft.worker.serve import assign_prompts
from epdraft.worker.summary import RankReport, RequestOutcome, format_summary, generations, summarize


def _report(rank, requests, seconds=2.0, layout="alltoall"):
    # exclusive seconds, as PhaseTimers books them
    phases = {"verify": 0.5, "sync": 0.1, "draft_attention": 0.3, "moe_experts": 0.3, "moe_dispatch": 0.2,
              "moe_combine": 0.1}
    return RankReport(rank=rank, steps=4, loop_seconds=seconds, phases=phases, requests=requests, layout=layout)


def test_summary_counts_the_bonus_and_splits_phases():
    ok = RequestOutcome(request_id=0, rank=0, tokens=[1, 2, 3, 4, 5, 6], accept_lens=[3, 1], reference_tokens=[1, 2, 3, 4, 5, 6])
    bad = RequestOutcome(request_id=1, rank=1, error="request 1: empty prompt")
    s = summarize([_report(0, [ok]), _report(1, [bad], seconds=3.0)], config="c.toml")
    assert s.accept_length == 3.0 and s.accepted_drafts_per_step == 2.0
    assert s.accept_length_per_rank == {0: 3.0, 1: 0.0}
    assert s.generated_tokens == 6 and s.tokens_per_s == 2.0  # the slowest rank's loop time
    assert s.failed_requests == {1: "request 1: empty prompt"}
    assert abs(s.phase_seconds["draft_attention"] - 0.3) < 1e-9
    assert abs(s.phase_seconds["other"] - 1.5) < 1e-9  # the run's 3.0 s wall less each rank's 1.5 s of phases
    assert abs(sum(s.phase_seconds.values()) - s.seconds) < 1e-9
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


def test_sampled_requests_get_a_row_per_setting_and_are_not_called_lossless():
    from epdraft.config.sampling import SamplingParams

    hot = SamplingParams(temperature=0.7, top_k=5, seed=1)
    warm = SamplingParams(temperature=0.7, top_k=5, seed=2)  # the seed is no setting of its own
    nucleus = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
    greedy = RequestOutcome(request_id=0, rank=0, tokens=[1, 2, 3, 4], accept_lens=[2, 0], tests=3,
                            expected_accepts=2.0, reference_tokens=[1, 2, 3, 4])  # fmt: skip
    a = RequestOutcome(request_id=1, rank=0, sampling=hot, tokens=[1, 2], accept_lens=[1, 0, 0], tests=5,
                       expected_accepts=2.5)  # fmt: skip
    b = RequestOutcome(request_id=2, rank=1, sampling=warm, tokens=[1, 2], accept_lens=[2], tests=3,
                       expected_accepts=2.0)  # fmt: skip
    c = RequestOutcome(request_id=3, rank=1, sampling=nucleus, tokens=[1], accept_lens=[1])  # tests unknown
    refused = RequestOutcome(request_id=4, rank=1, sampling=hot, error="request 4: empty prompt")
    s = summarize([_report(0, [greedy, a]), _report(1, [b, c, refused])], config="c")
    assert [r.label for r in s.per_sampling] == ["greedy", "T=0.7 top_k=5", "T=1 top_p=0.9"]
    g, h, n = s.per_sampling
    assert (g.requests, g.verify_steps, g.accept_length, g.tests) == (1, 2, 2.0, 3)
    assert g.accept_rate == 2 / 3 and g.expected_rate == 2 / 3
    assert (h.requests, h.verify_steps, h.accept_length, h.tests) == (2, 4, 1.75, 8)  # the refused one is not served
    assert h.accept_rate == 3 / 8 and h.expected_rate == 4.5 / 8
    assert n.tests is None and n.accept_rate is None and n.expected_rate is None and n.accept_length == 2.0
    assert s.lossless is True and s.lossless_requests == 1 and s.sampled_requests == 3
    text = format_summary(s)
    assert "    T=0.7 top_k=5               2 requests   accept length 1.75, rate 0.38, expected 0.56 (over 8 tests)" in text
    assert "    T=1 top_p=0.9                1 request   accept length 2.00, rates not reported by the target" in text
    assert ("lossless: OK for the 1 greedy request; 3 sampled requests are exact in distribution by construction "
            "(tests/e2e/test_sampling_exact.py checks it), not compared token by token") in text
    encoded = msgspec.json.decode(msgspec.json.encode(s))  # --json carries the table
    assert encoded["per_sampling"][1]["label"] == "T=0.7 top_k=5" and encoded["per_sampling"][1]["tests"] == 8


def test_an_all_greedy_run_has_no_sampling_table_and_the_old_verdict():
    a = RequestOutcome(request_id=0, rank=0, tokens=[1, 2], accept_lens=[1], tests=1, reference_tokens=[1, 2])
    s = summarize([_report(0, [a])], config="c")
    assert s.per_sampling == [] and "per sampling setting" not in format_summary(s)
    assert "lossless: OK (every request equals the target's own greedy decode)" in format_summary(s)


def test_lossless_line_when_nothing_greedy_was_compared():
    from epdraft.config.sampling import SamplingParams

    hot = SamplingParams(temperature=0.5, seed=1)
    sampled = RequestOutcome(request_id=0, rank=0, sampling=hot, tokens=[1], accept_lens=[0])
    unchecked = RequestOutcome(request_id=1, rank=0, tokens=[1], accept_lens=[0])
    only = format_summary(summarize([_report(0, [sampled])], config="c"))
    assert "lossless: no greedy request to check; 1 sampled request is exact in distribution" in only
    both = format_summary(summarize([_report(0, [sampled, unchecked])], config="c"))
    assert "lossless: not checked for the 1 greedy request; 1 sampled request is exact" in both


def test_time_split_prints_rows_that_sum_to_the_wall_and_the_start_up_apart():
    report = _report(0, [RequestOutcome(request_id=0, rank=0, tokens=[1, 2], accept_lens=[1])], seconds=2.0)
    report.startup_seconds = 7.25
    text = format_summary(summarize([report], config="c"))
    assert "start-up: 7.25 s (models loaded, runtime built, CUDA graphs captured when on; not in the throughput)" \
        in text
    assert "tokens in 2.00 s" in text
    assert "the rows sum to 2.000 s" in text
    assert "other (host loop; a rank done before the slowest)" in text and "0.500 s" in text


def test_disaggregated_draft_rank_phases_are_shown_inside_transfer_and_not_summed():
    report = RankReport(rank=0, steps=3, loop_seconds=2.0, phases={"prefill": 0.2, "verify": 0.5, "transfer": 1.2},
                        requests=[], draft_rank_phases={"draft_attention": 0.7, "moe_dispatch": 0.3})  # fmt: skip
    s = summarize([report], config="c")
    assert abs(sum(s.phase_seconds.values()) - 2.0) < 1e-9 and abs(s.phase_seconds["other"] - 0.1) < 1e-9
    assert s.draft_rank_seconds == {"draft_attention": 0.7, "moe_dispatch": 0.3}
    text = format_summary(s)
    assert "of which the draft ranks (mean, inside the transfer row):" in text
    assert text.index("draft MoE dispatch") > text.index("of which the draft ranks")
