"""The `run` job of a worker rank: load the target and the draft, serve this rank's prompts, report to rank 0."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Literal

import msgspec
import torch
import torch.distributed as dist

from epdraft.config.parallel import ParallelConfig
from epdraft.models.spec import check_against_target
from epdraft.runtime import DraftRuntime, draft_spec, resolve_layout
from epdraft.target.hf import HFTarget
from epdraft.target.prompts import read_prompts
from epdraft.worker.generate import RankReport, assign_prompts, greedy_reference, serve_rank
from epdraft.worker.groups import Groups
from epdraft.worker.summary import format_summary, summarize
from epdraft.worker.timing import PhaseTimers

log = logging.getLogger(__name__)


class RunJob(msgspec.Struct, frozen=True, kw_only=True):
    """What `epdraft run` asks every rank to do."""

    draft: str
    target: str
    prompts: str
    max_new_tokens: int = 64
    max_prompts: int = 0
    check_lossless: bool = True
    json_out: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


def run_job(pc: ParallelConfig, config_path: str, groups: Groups, job: RunJob) -> bool:
    """Serve the job's prompts over the draft DP ranks; rank 0 prints (and writes) the summary.

    Returns False when the lossless check failed (rank 0), True otherwise.
    """
    spec = draft_spec(job.draft)
    device = "cuda" if pc.cluster.device == "cuda" or (pc.cluster.device == "auto" and torch.cuda.is_available()) else "cpu"
    if device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, job.dtype)
    target = HFTarget.from_pretrained(job.target, spec.target_layer_ids, dtype=dtype, device=device)
    check_against_target(
        spec, hidden_size=target.hidden_size, num_layers=target.num_layers, vocab_size=target.vocab_size
    )
    timers = PhaseTimers(device)
    runtime = DraftRuntime.from_config(
        pc, job.draft, target, groups=groups, dtype=dtype, device=device, num_extras=2, timers=timers
    )
    try:
        prompts = read_prompts(job.prompts, job.max_prompts, tokenizer_dir=job.target)
        mine = assign_prompts([len(p) for p in prompts], job.max_new_tokens, groups.dp_size)[groups.dp_rank]
        log.info("%d of %d prompts on this rank", len(mine), len(prompts))
        report = serve_rank(
            runtime,
            target,
            {i: prompts[i] for i in mine},
            rank=dist.get_rank(),
            max_new_tokens=job.max_new_tokens,
            timers=timers,
        )
    finally:
        runtime.close()
    if job.check_lossless:
        attach_references(report, target, prompts, job.max_new_tokens)
    root = dist.get_process_group_ranks(groups.cpu)[0]
    return report_to_root(report, job, pc, config_path, group=groups.cpu, root=root)


def layout_label(pc: ParallelConfig, draft_path: str) -> str:
    """The MoE layout as it runs (`auto` resolved), with the padding for gather: what the summary names."""
    layout, padding, _ = resolve_layout(pc, draft_path)
    label = f"{layout} ({padding})" if layout == "gather" else layout
    return f"{label}, chosen by auto" if pc.draft.moe_layout == "auto" else label


def attach_references(report: RankReport, target: HFTarget, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Give each served request the target's own greedy decode, which its tokens must equal."""
    for o in report.requests:
        if o.error is None:
            o.reference_tokens = greedy_reference(target.model, prompts[o.request_id], max_new_tokens)


def report_to_root(
    report: RankReport,
    job: RunJob,
    pc: ParallelConfig,
    config_path: str,
    *,
    group: dist.ProcessGroup | None,
    root: int,
    select: Callable[[list[RankReport]], list[RankReport]] = lambda reports: reports,
) -> bool:
    """Gather every rank's report on `root` (a global rank of `group`), which prints the summary
    (and writes it as JSON when asked); `select` picks and merges the reports that make it.

    Returns False on the root when the lossless check failed, True otherwise.
    """
    is_root = dist.get_rank() == root
    gathered: list[bytes | None] | None = [None] * dist.get_world_size(group) if is_root else None
    dist.gather_object(msgspec.msgpack.encode(report), gathered, dst=root, group=group)
    if not is_root:
        return True
    reports = select([msgspec.msgpack.decode(b, type=RankReport) for b in gathered])
    summary = summarize(
        reports, config=config_path, layout=layout_label(pc, job.draft), parallel_config=pc.to_dict()
    )
    print(format_summary(summary), flush=True)
    if job.json_out:
        Path(job.json_out).write_bytes(msgspec.json.format(msgspec.json.encode(summary)) + b"\n")
    return summary.lossless is not False and summary.generated_tokens > 0  # all refused is no success
