"""The `run` job under `placement.mode = "disaggregated"`: target ranks and draft ranks apart.

A target rank loads the whole target (to prefill and verify); a draft rank reads only the
embedding and lm_head the draft reads through (`epdraft.target.heads.HFHeads`). Target ranks split
the prompts among themselves like colocated DP ranks do, pair with a draft rank
(`epdraft.worker.pairing`) and talk to it over `placement.transfer`; rank 0 (a target rank) gathers
every rank's report and prints the summary.

Greedy only: the link carries drafts, not the proposal probabilities a sampled request's verify
needs, so a run with a sampled prompt is refused before anything loads (`refuse_sampled`, which
`epdraft run`'s preflight calls too).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from epdraft.config.parallel import ParallelConfig
from epdraft.config.sampling import SamplingParams
from epdraft.errors import ConfigError
from epdraft.models.spec import check_against_target
from epdraft.parallel.address import is_loopback
from epdraft.parallel.groups import Groups
from epdraft.parallel.watchdog import Watchdog
from epdraft.runtime import DraftRuntime, PhaseTimers
from epdraft.target.heads import HFHeads
from epdraft.target.hf import HFTarget
from epdraft.target.prompts import Prompt
from epdraft.worker.disagg import RemoteDrafter, serve_draft_rank
from epdraft.worker.job import RankSetup, RunJob, finish, pool_limits, rank_setup
from epdraft.worker.pairing import PeerLink, paired_draft_rank, paired_target_ranks
from epdraft.worker.serve import assign_prompts, serve_requests
from epdraft.worker.summary import DRAFT_RANK_PHASES, RankReport
from epdraft.worker.transfer import make_transport
from epdraft.worker.transfer.control import ControlChannel

log = logging.getLogger(__name__)

def run_disaggregated_job(
    pc: ParallelConfig, config_path: str, groups: Groups | None, job: RunJob, watchdog: Watchdog
) -> str | None:
    """Serve the job's prompts under disaggregated placement; rank 0 (a target rank) prints (and
    writes) the summary.

    `groups` is None exactly on target ranks. `watchdog`: this rank's, told each phase. Returns, on
    rank 0, why the run failed although every rank finished (the lossless check, no token
    generated); None otherwise.
    """
    watchdog.progress(phase="reading the draft config and prompts")
    setup = rank_setup(pc, config_path, job)
    refuse_sampled(job.sampling, setup.prompts, job.prompts)
    watchdog.progress(phase="serving (disaggregated)")
    report, target, select = run_disaggregated(pc, groups, job, setup, watchdog)
    return finish(report, target, job, pc, config_path, setup.prompts, group=None, root=0, select=select,
                  watchdog=watchdog)  # fmt: skip


def refuse_sampled(defaults: SamplingParams, prompts: Sequence[Prompt], path: str) -> None:
    """Raise ConfigError naming `--temperature` (the run's default) or the first sampled prompt's
    line: a disaggregated draft's proposal probabilities do not cross the link yet."""
    why = "needs placement.mode = 'colocated' (a disaggregated draft's proposal probabilities do not cross the link yet)"
    if not defaults.greedy:
        raise ConfigError(f"--temperature {defaults.temperature:g} {why}")
    sampled = next((p for p in prompts if not p.sampling.greedy), None)
    if sampled is not None:
        raise ConfigError(f"--prompts {path}:{sampled.line}: temperature {sampled.sampling.temperature:g} {why}")


def run_disaggregated(
    pc: ParallelConfig, groups: Groups | None, job: RunJob, setup: RankSetup, watchdog: Watchdog
) -> tuple[RankReport, HFTarget | None, Callable[[list[RankReport]], list[RankReport]]]:
    """Serve this rank's side; returns its report, its target (None on a draft rank) and how rank 0
    merges the reports (the target ranks', with the draft ranks' phases, layout and kernels folded in).

    `groups` is None exactly on target ranks. Raises ParallelError naming the peer rank that
    stopped answering, StepMismatch on a step-id mismatch.
    """
    started = time.perf_counter()
    rank = dist.get_rank()
    control = Groups.pair_control(pc)
    transfer_group = control if pc.placement.transfer == "mooncake" else dist.group.WORLD
    mooncake = pc.placement.transfer == "mooncake"  # only its endpoint is an address peers dial
    transport = make_transport(pc.placement.transfer, transfer_group, device=setup.device,
                               **({"hostname": this_host(job.master_addr)} if mooncake else {}))  # fmt: skip
    spec = setup.spec
    link = PeerLink(ControlChannel(control, torch.device("cpu"), use_tags=True), transport,
                    role="draft" if groups is not None else "target", block_size=spec.num_drafts + 1)  # fmt: skip
    timers = PhaseTimers(setup.device)
    target: HFTarget | None = None
    try:
        if groups is not None:
            heads = HFHeads.from_pretrained(job.target, dtype=setup.target_dtype, device=setup.device)
            check_against_target(
                spec, hidden_size=heads.hidden_size, num_layers=heads.num_layers, vocab_size=heads.vocab_size
            )
            report = _serve_draft(pc, job, groups, heads, link, timers, rank, setup, watchdog)
        else:
            target = HFTarget.from_pretrained(
                job.target, spec.target_layer_ids, dtype=setup.target_dtype, device=setup.device
            )
            check_against_target(
                spec, hidden_size=target.hidden_size, num_layers=target.num_layers, vocab_size=target.vocab_size
            )
            startup = timers.now() - started
            report = _serve_target(pc, target, link, setup.prompts, timers, rank, job, watchdog)
            report.startup_seconds = startup
    finally:
        link.close()
    return report, target, lambda reports: _target_reports(pc, reports)


def _serve_target(
    pc: ParallelConfig,
    target: HFTarget,
    link: PeerLink,
    prompts: list[Prompt],
    timers: PhaseTimers,
    rank: int,
    job: RunJob,
    watchdog: Watchdog,
) -> RankReport:
    dp_rank = pc.target_ranks.index(rank)
    mine = assign_prompts([len(p.ids) for p in prompts], job.max_new_tokens, pc.target_world_size)[dp_rank]
    draft_rank = paired_draft_rank(pc, rank)
    log.info("target DP rank %d: %d of %d prompts, drafts from rank %d", dp_rank, len(mine), len(prompts), draft_rank)
    feature_dim = len(target.feature_layer_ids) * target.hidden_size
    drafter = RemoteDrafter(link, draft_rank, feature_dim, target.model.dtype, timers)
    return serve_requests(
        target, drafter, {i: prompts[i] for i in mine}, rank=rank, max_new_tokens=job.max_new_tokens, timers=timers,
        watchdog=watchdog,
    )


def _serve_draft(
    pc: ParallelConfig,
    job: RunJob,
    groups: Groups,
    heads: HFHeads,
    link: PeerLink,
    timers: PhaseTimers,
    rank: int,
    setup: RankSetup,
    watchdog: Watchdog,
) -> RankReport:
    targets = paired_target_ranks(pc, rank)
    log.info("draft DP rank %d serves target ranks %s", groups.dp_rank, list(targets))
    prompts = setup.prompts
    per_target = assign_prompts([len(p.ids) for p in prompts], job.max_new_tokens, pc.target_world_size)
    shares = [[i for t in paired_target_ranks(pc, d) for i in per_target[pc.target_ranks.index(t)]]
              for d in pc.draft_ranks]  # fmt: skip
    runtime = DraftRuntime.from_config(
        pc, job.draft, heads, groups=groups, spec=setup.spec, dtype=setup.dtype, device=heads.device, timers=timers,
        watchdog=watchdog, **pool_limits(pc, job, prompts, shares, setup.spec.block_size),
    )  # fmt: skip
    try:
        runtime.warm_up()
        link.register_as_draft(targets)
        steps = serve_draft_rank(runtime, link, targets, rank=rank)
    finally:
        runtime.close()
    return RankReport(
        rank=rank, steps=steps, loop_seconds=0.0, phases=timers.as_dict(), requests=[], layout=runtime.layout.label,
        kernels=runtime.kernels.label,
    )


def _target_reports(pc: ParallelConfig, reports: list[RankReport]) -> list[RankReport]:
    """The target ranks' reports, each with the draft ranks' mean phase times beside its own (they
    ran inside the target's transfer phase, so they are not added to its phases)."""
    drafts = [r for r in reports if r.rank in pc.draft_ranks]
    mean = {k: sum(r.phases.get(k, 0.0) for r in drafts) / max(len(drafts), 1) for k in DRAFT_RANK_PHASES}
    layout = next((r.layout for r in drafts if r.layout), "")
    kernels = next((r.kernels for r in drafts if r.kernels), "")
    out = []
    for r in reports:
        if r.rank in pc.target_ranks:
            r.draft_rank_phases = mean
            r.layout, r.kernels = layout, kernels
            out.append(r)
    return out


_ANY_REMOTE = "10.255.255.255"  # an address off this host: the route to it is the default one


def this_host(master_addr: str) -> str:
    """The address paired ranks reach this rank at (Mooncake's endpoint): loopback when the world's
    master (`master_addr`, the launcher's `--master-addr`) is loopback, since then every rank is on
    this host; else this host's address on its route to the master (the interface the other hosts
    reached the master through), or on the master's own host (whose name may resolve to loopback
    there: stock Debian / Ubuntu map the hostname to 127.0.1.1) on its default route.

    Raises ConfigError naming --master-addr when neither route leaves this host.
    """
    if is_loopback(master_addr):
        return "127.0.0.1"
    found = []
    for destination in (master_addr, _ANY_REMOTE):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((destination, 1))  # a datagram socket's connect picks the route; nothing is sent
                address = probe.getsockname()[0]
        except OSError as e:
            found.append(f"to {destination}: {e}")
            continue
        if not is_loopback(address):
            return address
        found.append(f"to {destination}: loopback {address}")
    raise ConfigError(f"--master-addr {master_addr}: no address of this host that paired ranks on other hosts can "
                      f"dial (routes {'; '.join(found)})")  # fmt: skip
