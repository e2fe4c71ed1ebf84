"""The run summary rank 0 prints: acceptance, throughput, where the time went, and the lossless check.

When any request samples, acceptance is also shown per sampling setting, with the accept rate the
draft could expect (sum_x min(p, q) per accept test, from the target's verify): a low accept
length with an expected rate as low is the draft's; a measured rate well below the expected one
points at the sampler.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from epdraft.config.sampling import SamplingParams

PHASES = (
    ("prefill", "target prefill"),
    ("verify", "target verify"),
    ("transfer", "transfer (target waiting on draft ranks)"),
    ("sync", "step sync"),
    ("draft_prompt", "draft context of new prompts (fc + K/V)"),
    ("draft_context", "draft commit of verified rows (fc + K/V)"),
    ("draft_attention", "draft step outside its MoE (attention, norms, lm_head)"),
    ("moe_dispatch", "draft MoE dispatch"),
    ("moe_experts", "draft MoE router + experts + shared"),
    ("moe_combine", "draft MoE combine"),
    ("draft_step_graph", "draft step (graph)"),
    ("other", "other (host loop; a rank done before the slowest)"),
)
"""Rows of the time split, in order: disjoint (`PhaseTimers` books a nested phase to itself only);
"other" is the run's wall time (the slowest rank's) less the rank's phases, so the rows of every
rank, and their mean over ranks, sum to the run's wall time."""

DRAFT_RANK_PHASES = ("sync", "draft_prompt", "draft_context", "draft_attention", "moe_dispatch", "moe_experts", "moe_combine",
                     "draft_step_graph")  # fmt: skip
"""The disaggregated draft ranks' rows: their time is inside the target's "transfer", so they are
shown under it and left out of the sum."""

ITERATION_PHASES = ("sync", "draft_context", "draft_attention", "moe_dispatch", "moe_experts", "moe_combine",
                    "draft_step_graph")  # fmt: skip
"""What an engine pays the draft between two verifies once its requests run (not their prompts')."""


class RequestOutcome(msgspec.Struct, kw_only=True):
    """One request's result, as gathered to rank 0.

    sampling: how it sampled (seed resolved). tests: accept tests its verify steps ran (accepted
    drafts + the first rejected, at most K a step); expected_accepts: the sum over those tests of
    sum_x min(p, q), the accepts its draft could expect; both None when the target did not report
    them. reference_tokens: the target's own greedy decode (greedy requests, when checked).
    """

    request_id: int
    rank: int
    sampling: SamplingParams = SamplingParams()
    tokens: list[int] = []
    accept_lens: list[int] = []
    tests: int | None = None
    expected_accepts: float | None = None
    error: str | None = None
    reference_tokens: list[int] | None = None


class RankReport(msgspec.Struct, kw_only=True):
    """What one rank sends to rank 0 after the run.

    layout: the MoeLayout label of the draft this rank ran or was served by ("" on a rank that
    knows none: a disaggregated target rank, until the draft ranks' label is folded in);
    kernels: the StepKernels label of that draft, the same way. loop_seconds: the serving wall
    time (prefill through the last step); phases: exclusive seconds per `PhaseTimers` name inside
    it; startup_seconds: loading the models and building the runtime, before it (not in the
    throughput). draft_rank_phases: a disaggregated target rank's paired draft ranks' mean phases.
    """

    rank: int
    steps: int
    loop_seconds: float
    phases: dict[str, float]
    requests: list[RequestOutcome]
    layout: str = ""
    kernels: str = ""
    startup_seconds: float = 0.0
    draft_rank_phases: dict[str, float] = {}


class Generation(msgspec.Struct, kw_only=True):
    """One request's generated tokens, and their text when the target has a tokenizer (`--show`)."""

    request_id: int
    rank: int
    tokens: list[int]
    text: str | None
    error: str | None = None


class SamplingRow(msgspec.Struct, kw_only=True):
    """Acceptance of the served requests of one sampling setting (`sampling_label`).

    accept_rate: accepted drafts / accept tests; expected_rate: expected accepts / accept tests
    (None when the target reported no tests for these requests).
    """

    label: str
    requests: int
    verify_steps: int
    accept_length: float
    tests: int | None
    accept_rate: float | None
    expected_rate: float | None


class RunSummary(msgspec.Struct, kw_only=True):
    """What `epdraft run` reports (also written as JSON with --json).

    `accept_length` is SGLang's: tokens committed per verify step, the bonus token included (so 1.0
    means no draft was ever accepted); `accepted_drafts_per_step` is the same minus one.
    `lossless` is about the greedy requests only (`lossless_requests` compared); the
    `sampled_requests` served are exact in distribution, not compared token by token.
    `per_sampling`: one row per sampling setting, when any request sampled (else empty).
    `seconds`: the slowest rank's serving wall time (prefill through the last step), which the
    throughput divides by; `startup_seconds`: the slowest rank's start-up before it (models loaded,
    runtime built), not in the throughput. `phase_seconds`: one value per `PHASES` row, each the
    mean over ranks, "other" included, so they sum to `seconds`.
    `draft_rank_seconds`: disaggregated only, the draft ranks' phases (inside "transfer").
    """

    config: str
    parallel_config: dict
    layout: str
    kernels: str
    ranks: int
    requests: int
    failed_requests: dict[int, str]
    generated_tokens: int
    verify_steps: int
    accept_length: float
    accepted_drafts_per_step: float
    accept_length_per_rank: dict[int, float]
    requests_per_rank: dict[int, int]
    steps: int
    seconds: float
    tokens_per_s: float
    phase_seconds: dict[str, float]
    startup_seconds: float = 0.0
    draft_rank_seconds: dict[str, float] = {}
    lossless: bool | None
    first_mismatch: str | None
    lossless_requests: int = 0
    sampled_requests: int = 0
    per_sampling: list[SamplingRow] = []
    shown: list[Generation] = []


def phase_rows(raw: dict[str, float], wall: float) -> dict[str, float]:
    """One rank's `PHASES` rows from its timers' exclusive totals and the run's wall time ("other"
    = wall - the phases). A timer name outside `PHASES` is a bug, not a row to drop quietly."""
    known = {k for k, _ in PHASES}
    unknown = sorted(set(raw) - known)
    assert not unknown, f"phase timers {unknown} have no summary row"
    rows = {k: raw.get(k, 0.0) for k, _ in PHASES if k != "other"}
    rows["other"] = wall - sum(rows.values())
    return rows


def sampling_label(params: SamplingParams) -> str:
    """A setting's name in the summary, without the seed: "greedy", "T=0.7 top_k=5 top_p=0.9"."""
    if params.greedy:
        return "greedy"
    parts = [f"T={params.temperature:g}"]
    if params.top_k is not None:
        parts.append(f"top_k={params.top_k}")
    if params.top_p < 1.0:
        parts.append(f"top_p={params.top_p:g}")
    return " ".join(parts)


def per_sampling(served: list[RequestOutcome]) -> list[SamplingRow]:
    """One row per sampling setting of the served requests, greedy first, then by label."""
    groups: dict[str, list[RequestOutcome]] = {}
    for o in served:
        groups.setdefault(sampling_label(o.sampling), []).append(o)
    rows = []
    for label in sorted(groups, key=lambda k: (k != "greedy", k)):
        outcomes = groups[label]
        accepts = [a for o in outcomes for a in o.accept_lens]
        known = [o for o in outcomes if o.tests is not None]
        tests = sum(o.tests for o in known) if known else None
        accepted = sum(a for o in known for a in o.accept_lens)
        expected = [o.expected_accepts for o in known if o.expected_accepts is not None]
        rows.append(SamplingRow(
            label=label,
            requests=len(outcomes),
            verify_steps=len(accepts),
            accept_length=1 + sum(accepts) / len(accepts) if accepts else 0.0,
            tests=tests,
            accept_rate=accepted / tests if tests else None,
            expected_rate=sum(expected) / tests if tests and len(expected) == len(known) else None,
        ))  # fmt: skip
    return rows


def summarize(reports: list[RankReport], *, config: str, parallel_config: dict | None = None) -> RunSummary:
    """Combine every rank's report; phases are averaged over ranks, throughput uses the slowest rank.

    The layout and kernels are the ones the ranks report (each rank's resolved MoeLayout and
    StepKernels; every rank of a run resolves the same). `parallel_config`
    (the resolved ParallelConfig as a dict) is saved with the numbers it produced.
    """
    outcomes = sorted((o for r in reports for o in r.requests), key=lambda o: o.request_id)
    ok = [o for o in outcomes if o.error is None]
    accepts = [a for o in ok for a in o.accept_lens]
    seconds = max(r.loop_seconds for r in reports)
    generated = sum(len(o.tokens) for o in ok)
    per_rank = {}
    for r in reports:
        acc = [a for o in r.requests if o.error is None for a in o.accept_lens]
        per_rank[r.rank] = 1 + sum(acc) / len(acc) if acc else 0.0
    phases = [phase_rows(r.phases, seconds) for r in reports]
    lossless, mismatch = None, None
    checked = [o for o in ok if o.reference_tokens is not None]
    if checked:
        lossless = True
        for o in checked:
            if o.tokens != o.reference_tokens:
                pos = next((i for i, (a, b) in enumerate(zip(o.tokens, o.reference_tokens)) if a != b), None)
                pos = min(len(o.tokens), len(o.reference_tokens)) if pos is None else pos
                lossless, mismatch = False, f"request {o.request_id} (rank {o.rank}) differs at generated position {pos}"
                break
    mean_acc = sum(accepts) / len(accepts) if accepts else 0.0
    sampled = [o for o in ok if not o.sampling.greedy]
    return RunSummary(
        config=config,
        parallel_config=parallel_config or {},
        layout=next((r.layout for r in reports if r.layout), "none"),
        kernels=next((r.kernels for r in reports if r.kernels), "none"),
        ranks=len(reports),
        requests=len(outcomes),
        failed_requests={o.request_id: o.error for o in outcomes if o.error is not None},
        generated_tokens=generated,
        verify_steps=len(accepts),
        accept_length=mean_acc + 1 if accepts else 0.0,
        accepted_drafts_per_step=mean_acc,
        accept_length_per_rank=per_rank,
        requests_per_rank={r.rank: len(r.requests) for r in reports},
        steps=max(r.steps for r in reports),
        seconds=seconds,
        tokens_per_s=generated / seconds if seconds > 0 else 0.0,
        phase_seconds={k: sum(p[k] for p in phases) / len(phases) for k, _ in PHASES},
        startup_seconds=max(r.startup_seconds for r in reports),
        draft_rank_seconds=next((r.draft_rank_phases for r in reports if r.draft_rank_phases), {}),
        lossless=lossless,
        first_mismatch=mismatch,
        lossless_requests=len(checked),
        sampled_requests=len(sampled),
        per_sampling=per_sampling(ok) if sampled else [],
    )


def generations(reports: list[RankReport], n: int, *, tokenizer_dir: str | Path) -> list[Generation]:
    """The first `n` requests (by id) as generated, decoded with the target's tokenizer when it has
    one (a target saved without one shows token ids only: nothing is guessed)."""
    from epdraft.target.prompts import saved_tokenizer

    outcomes = sorted((o for r in reports for o in r.requests), key=lambda o: o.request_id)[:n]
    tokenizer = saved_tokenizer(tokenizer_dir, "--show")
    return [
        Generation(request_id=o.request_id, rank=o.rank, tokens=o.tokens, error=o.error,
                   text=tokenizer.decode(o.tokens) if tokenizer is not None and o.error is None else None)  # fmt: skip
        for o in outcomes
    ]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _sampling_lines(s: RunSummary) -> list[str]:
    """The per-setting table (none when every request was greedy)."""
    if not s.per_sampling:
        return []
    lines = ["  per sampling setting (rate: accepted drafts per accept test; expected: the rate the draft's "
             "proposals could get, sum_x min(p, q) per test):"]  # fmt: skip
    for row in s.per_sampling:
        rates = "rates not reported by the target"
        if row.accept_rate is not None:
            expected = f"{row.expected_rate:.2f}" if row.expected_rate is not None else "not reported"
            rates = f"rate {row.accept_rate:.2f}, expected {expected} (over {row.tests} tests)"
        lines.append(f"    {row.label:<24}{_count(row.requests, 'request'):>14}   accept length "
                     f"{row.accept_length:.2f}, {rates}")  # fmt: skip
    return lines


def _lossless_line(s: RunSummary) -> str:
    """The verdict on the greedy requests, and what holds for the sampled ones instead."""
    if s.sampled_requests == 0:
        if s.lossless is None:
            return "lossless: not checked"
        return ("lossless: OK (every request equals the target's own greedy decode)" if s.lossless
                else f"lossless: FAIL: {s.first_mismatch}")  # fmt: skip
    sampled = (f"{_count(s.sampled_requests, 'sampled request')} "
               f"{'is' if s.sampled_requests == 1 else 'are'} exact in distribution by construction "
               "(tests/e2e/test_sampling_exact.py checks it), not compared token by token")  # fmt: skip
    greedy = s.requests - len(s.failed_requests) - s.sampled_requests
    if s.lossless is True:
        verdict = f"OK for the {_count(s.lossless_requests, 'greedy request')}"
    elif s.lossless is False:
        verdict = f"FAIL: {s.first_mismatch}"
    elif greedy:
        verdict = f"not checked for the {_count(greedy, 'greedy request')}"
    else:
        verdict = "no greedy request to check"
    return f"lossless: {verdict}; {sampled}"


def _phase_lines(s: RunSummary) -> list[str]:
    """The time split: disjoint rows that sum to the run's wall time, then the draft ranks' rows
    of a disaggregated run (inside its transfer row, not summed)."""
    total = sum(s.phase_seconds.values())
    lines = [f"time split (mean over ranks; the rows sum to {total:.3f} s):"]
    for key, label in PHASES:
        sec = s.phase_seconds[key]
        if sec == 0.0:  # a phase this run does not have (transfer when colocated, graph or eager rows)
            continue
        lines.append(f"  {label:<56}{sec:>9.3f} s {100 * sec / (total or 1.0):>6.1f} %")
    iteration = sum(s.phase_seconds.get(k, 0.0) for k in ITERATION_PHASES)
    if iteration and s.steps:
        lines.append(f"draft iteration (step sync + commit + propose): {1e3 * iteration / s.steps:.3f} ms per step "
                     f"over {s.steps} steps")
    if s.draft_rank_seconds:
        lines.append("  of which the draft ranks (mean, inside the transfer row):")
        for key, label in PHASES:
            sec = s.draft_rank_seconds.get(key, 0.0)
            if sec:
                lines.append(f"    {label:<54}{sec:>9.3f} s")
    return lines


def format_summary(s: RunSummary) -> str:
    """The human-readable summary."""
    lines = [
        f"epdraft run: {s.config} ({s.ranks} ranks, moe_layout {s.layout})",
        f"draft step: {s.kernels}",
        f"requests: {s.requests} ({len(s.failed_requests)} refused), per rank "
        + ", ".join(f"{r}: {n}" for r, n in sorted(s.requests_per_rank.items())),
    ]
    for rid, err in sorted(s.failed_requests.items()):
        lines.append(f"  refused request {rid}: {err}")
    lines += [
        f"accept length: {s.accept_length:.2f} tokens per verify step incl. the bonus "
        f"({s.accepted_drafts_per_step:.2f} drafts accepted), over {s.verify_steps} verify steps",
        "  per rank: " + ", ".join(f"{r}: {a:.2f}" for r, a in sorted(s.accept_length_per_rank.items())),
        *_sampling_lines(s),
        f"throughput: {s.generated_tokens} tokens in {s.seconds:.2f} s = {s.tokens_per_s:.1f} tok/s "
        f"({s.steps} global steps; prefill through the last step)",
        f"start-up: {s.startup_seconds:.2f} s (models loaded, runtime built, CUDA graphs captured when on; "
        "not in the throughput)",
        *_phase_lines(s),
    ]
    lines.append(_lossless_line(s))
    for g in s.shown:
        if g.error is not None:
            lines.append(f"request {g.request_id} (rank {g.rank}): refused")
        elif g.text is not None:
            lines.append(f"request {g.request_id} (rank {g.rank}): {g.text!r}")
        else:
            lines.append(f"request {g.request_id} (rank {g.rank}), token ids (the target has no tokenizer): {g.tokens}")
    return "\n".join(lines)
