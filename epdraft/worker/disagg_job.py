"""The `run` job under `placement.mode = "disaggregated"`: target ranks and draft ranks apart.

A target rank loads the whole target (to prefill and verify); a draft rank reads only the
embedding and lm_head the draft reads through (`epdraft.target.heads.HFHeads`). Target ranks split
the prompts among themselves like colocated DP ranks do, pair with a draft rank
(`epdraft.worker.pairing`) and talk to it over `placement.transfer`; rank 0 (a target rank) gathers
every rank's report and prints the summary.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket

import torch
import torch.distributed as dist

from epdraft.config.parallel import ParallelConfig
from epdraft.errors import RequestError
from epdraft.launch import is_loopback
from epdraft.models.spec import check_against_target
from epdraft.runtime import DraftRuntime, draft_spec
from epdraft.target.heads import HFHeads
from epdraft.target.hf import HFTarget
from epdraft.worker.disagg import serve_draft_rank, serve_target_rank, target_buffer_spec
from epdraft.worker.generate import RankReport, RequestOutcome, assign_prompts
from epdraft.worker.groups import Groups, resolve_backend
from epdraft.worker.job import RunJob, attach_references, read_prompts, report_to_root
from epdraft.worker.pairing import PeerLink, paired_draft_rank, paired_target_ranks
from epdraft.worker.timing import PhaseTimers
from epdraft.worker.transfer import make_transport
from epdraft.worker.transfer.control import ControlChannel

log = logging.getLogger(__name__)

# Phases only a draft rank measures; a target rank's report carries the draft ranks' mean of them.
_DRAFT_PHASES = ("sync", "draft_context", "draft_propose", "moe_total", "moe_dispatch", "moe_combine")


def run_disagg_job(pc: ParallelConfig, config_path: str, groups: Groups | None, job: RunJob) -> bool:
    """Serve the job with the target on `pc.target_ranks` and the draft on `pc.draft_ranks`.

    `groups` is None exactly on target ranks. Returns False when the lossless check failed (rank 0).
    Raises ParallelError naming the peer rank that stopped answering, StepMismatch on a step-id mismatch.
    """
    rank = dist.get_rank()
    device_type, backend = resolve_backend(pc)
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    # Control messages need tags and CPU tensors: the world group when it is gloo, else a gloo copy of it.
    control = dist.group.WORLD
    if backend != "gloo":
        timeout = datetime.timedelta(seconds=pc.cluster.timeout_s)
        control = dist.new_group(backend="gloo", timeout=timeout, group_desc="epdraft_pairs")
    transfer_group = control if pc.placement.transfer == "mooncake" else dist.group.WORLD
    transport = make_transport(pc.placement.transfer, transfer_group, device=device, hostname=_this_host())
    spec = draft_spec(job.draft)
    link = PeerLink(ControlChannel(control, torch.device("cpu"), use_tags=True), transport,
                    role="draft" if groups is not None else "target", block_size=spec.num_drafts + 1)  # fmt: skip
    dtype = getattr(torch, job.dtype)
    timers = PhaseTimers(device)
    prompts = read_prompts(job.prompts, job.max_prompts, tokenizer_dir=job.target)
    target: HFTarget | None = None
    try:
        if groups is not None:
            heads = HFHeads.from_pretrained(job.target, dtype=dtype, device=device)
            check_against_target(
                spec, hidden_size=heads.hidden_size, num_layers=heads.num_layers, vocab_size=heads.vocab_size
            )
            report = _serve_draft(pc, job, groups, heads, link, timers, rank)
        else:
            target = HFTarget.from_pretrained(job.target, spec.target_layer_ids, dtype=dtype, device=device)
            check_against_target(
                spec, hidden_size=target.hidden_size, num_layers=target.num_layers, vocab_size=target.vocab_size
            )
            report = _serve_target(pc, target, link, prompts, timers, rank, job)
    finally:
        link.close()
    if target is not None and job.check_lossless:
        attach_references(report, target, prompts, job.max_new_tokens)
    return report_to_root(
        report, job, pc, config_path, group=None, root=0, select=lambda rs: _target_reports(pc, rs)
    )


def _serve_target(
    pc: ParallelConfig,
    target: HFTarget,
    link: PeerLink,
    prompts: list[list[int]],
    timers: PhaseTimers,
    rank: int,
    job: RunJob,
) -> RankReport:
    dp_rank = pc.target_ranks.index(rank)
    mine = assign_prompts([len(p) for p in prompts], job.max_new_tokens, pc.target_world_size)[dp_rank]
    draft_rank = paired_draft_rank(pc, rank)
    log.info("target DP rank %d: %d of %d prompts, drafts from rank %d", dp_rank, len(mine), len(prompts), draft_rank)
    outcomes: dict[int, RequestOutcome] = {}
    prefilled: dict[int, tuple[int, torch.Tensor]] = {}
    for rid in mine:
        outcomes[rid] = RequestOutcome(request_id=rid, rank=rank)
        try:
            with timers.phase("prefill"):
                pre = target.prefill([rid], [prompts[rid]])
        except RequestError as e:
            log.warning("%s", e)
            outcomes[rid].error = str(e)
            continue
        prefilled[rid] = (int(pre.first_tokens[0]), pre.features)
    feature_dim = len(target.feature_layer_ids) * target.hidden_size
    dtype = next(iter(prefilled.values()))[1].dtype if prefilled else target.model.dtype
    buffer = target_buffer_spec([len(f) for _, f in prefilled.values()], link.block_size, feature_dim, dtype)
    link.register_as_target(draft_rank, buffer)
    return serve_target_rank(
        target, link, draft_rank, prefilled, outcomes, rank=rank, max_new_tokens=job.max_new_tokens, timers=timers
    )


def _serve_draft(
    pc: ParallelConfig, job: RunJob, groups: Groups, heads: HFHeads, link: PeerLink, timers: PhaseTimers, rank: int
) -> RankReport:
    targets = paired_target_ranks(pc, rank)
    log.info("draft DP rank %d serves target ranks %s", groups.dp_rank, list(targets))
    runtime = DraftRuntime.from_config(
        pc, job.draft, heads, groups=groups, dtype=heads.dtype, device=heads.device, timers=timers
    )
    try:
        link.register_as_draft(targets)
        steps = serve_draft_rank(runtime, link, targets, rank=rank)
    finally:
        runtime.close()
    return RankReport(rank=rank, steps=steps, loop_seconds=0.0, phases=timers.as_dict(), requests=[])


def _target_reports(pc: ParallelConfig, reports: list[RankReport]) -> list[RankReport]:
    """The target ranks' reports, each with the draft ranks' mean draft-side phase times folded in."""
    drafts = [r for r in reports if r.rank in pc.draft_ranks]
    mean = {k: sum(r.phases.get(k, 0.0) for r in drafts) / max(len(drafts), 1) for k in _DRAFT_PHASES}
    out = []
    for r in reports:
        if r.rank in pc.target_ranks:
            r.phases = {**r.phases, **mean}
            out.append(r)
    return out


def _this_host() -> str:
    """The address paired ranks reach this rank at (Mooncake's endpoint): loopback when the world's
    master (MASTER_ADDR, set by torchrun) is loopback, since then every rank is on this host."""
    if is_loopback(os.environ.get("MASTER_ADDR", "127.0.0.1")):
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())
