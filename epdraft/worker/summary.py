"""The run summary rank 0 prints: acceptance, throughput, where the time went, and the lossless check."""

from __future__ import annotations

from pathlib import Path

import msgspec

PHASES = (
    ("prefill", "target prefill"),
    ("verify", "target verify"),
    ("transfer", "transfer (target waiting on draft ranks)"),
    ("sync", "step sync"),
    ("draft_context", "draft context (fc + K/V)"),
    ("draft_attention", "draft attention, norms, lm_head"),
    ("moe_dispatch", "draft MoE dispatch"),
    ("moe_experts", "draft MoE router + experts + shared"),
    ("moe_combine", "draft MoE combine"),
)


class RequestOutcome(msgspec.Struct, kw_only=True):
    """One request's result, as gathered to rank 0."""

    request_id: int
    rank: int
    tokens: list[int] = []
    accept_lens: list[int] = []
    error: str | None = None
    reference_tokens: list[int] | None = None


class RankReport(msgspec.Struct, kw_only=True):
    """What one rank sends to rank 0 after the run.

    layout: the MoeLayout label of the draft this rank ran or was served by ("" on a rank that
    knows none: a disaggregated target rank, until the draft ranks' label is folded in);
    kernels: the StepKernels label of that draft, the same way.
    """

    rank: int
    steps: int
    loop_seconds: float
    phases: dict[str, float]
    requests: list[RequestOutcome]
    layout: str = ""
    kernels: str = ""


class Generation(msgspec.Struct, kw_only=True):
    """One request's generated tokens, and their text when the target has a tokenizer (`--show`)."""

    request_id: int
    rank: int
    tokens: list[int]
    text: str | None
    error: str | None = None


class RunSummary(msgspec.Struct, kw_only=True):
    """What `epdraft run` reports (also written as JSON with --json).

    `accept_length` is SGLang's: tokens committed per verify step, the bonus token included (so 1.0
    means no draft was ever accepted); `accepted_drafts_per_step` is the same minus one.
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
    lossless: bool | None
    first_mismatch: str | None
    shown: list[Generation] = []


def derive_phases(raw: dict[str, float]) -> dict[str, float]:
    """Split the timers' totals into disjoint phases (MoE experts = MoE total - dispatch - combine)."""
    moe = raw.get("moe_total", 0.0)
    dispatch, combine = raw.get("moe_dispatch", 0.0), raw.get("moe_combine", 0.0)
    return {
        "prefill": raw.get("prefill", 0.0),
        "verify": raw.get("verify", 0.0),
        "transfer": raw.get("transfer", 0.0),
        "sync": raw.get("sync", 0.0),
        "draft_context": raw.get("draft_context", 0.0),
        "draft_attention": raw.get("draft_propose", 0.0) - moe,
        "moe_dispatch": dispatch,
        "moe_experts": moe - dispatch - combine,
        "moe_combine": combine,
    }


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
    phases = [derive_phases(r.phases) for r in reports]
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
        lossless=lossless,
        first_mismatch=mismatch,
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
        f"throughput: {s.generated_tokens} tokens in {s.seconds:.2f} s = {s.tokens_per_s:.1f} tok/s "
        f"({s.steps} global steps)",
        "time split (mean over ranks):",
    ]
    total = sum(s.phase_seconds.values()) or 1.0
    for key, label in PHASES:
        sec = s.phase_seconds[key]
        if sec == 0.0:  # a phase this placement does not have (transfer when colocated)
            continue
        lines.append(f"  {label:<38}{sec:>9.3f} s {100 * sec / total:>6.1f} %")
    if s.lossless is None:
        lines.append("lossless: not checked")
    else:
        lines.append("lossless: OK (every request equals the target's own greedy decode)" if s.lossless
                     else f"lossless: FAIL: {s.first_mismatch}")
    for g in s.shown:
        if g.error is not None:
            lines.append(f"request {g.request_id} (rank {g.rank}): refused")
        elif g.text is not None:
            lines.append(f"request {g.request_id} (rank {g.rank}): {g.text!r}")
        else:
            lines.append(f"request {g.request_id} (rank {g.rank}), token ids (the target has no tokenizer): {g.tokens}")
    return "\n".join(lines)
