"""The `run` job of a worker rank: load what this rank holds, serve its prompts, report to rank 0.

What both placements share lives here (the job, the per-rank setup, the report to rank 0), and
the colocated job itself: every rank loads the target and a DraftRuntime and serves its share of
the prompts through `LocalDrafter`. The disaggregated job (`epdraft.worker.disagg_job`) builds on
this module, so the worker's entry point picks between the two and this module never imports it.
The draft's config.json is read once per rank (`read_draft_spec`) and the MoE layout resolved
once (`DraftRuntime.from_config`); everything below reads those.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Callable, Literal

import msgspec
import torch
import torch.distributed as dist

from epdraft.config.parallel import ParallelConfig, check_standalone_target
from epdraft.config.sampling import SamplingParams
from epdraft.layers.step_kernels import default_dtype
from epdraft.models.checkpoint import read_draft_spec
from epdraft.models.spec import DraftModelSpec, check_against_target
from epdraft.parallel.groups import Groups, resolve_backend
from epdraft.parallel.watchdog import Watchdog
from epdraft.runtime import DraftRuntime, PhaseTimers
from epdraft.sampling.batch import seeded
from epdraft.target.hf import HFTarget
from epdraft.target.prompts import Prompt, read_prompt_file
from epdraft.worker.output import write_outputs
from epdraft.worker.progress import Progress
from epdraft.worker.serve import LocalDrafter, assign_prompts, greedy_reference, serve_requests
from epdraft.worker.summary import RankReport, format_summary, generations, summarize

log = logging.getLogger(__name__)


class RunJob(msgspec.Struct, frozen=True, kw_only=True):
    """What `epdraft run` asks every rank to do.

    dtype: the draft's weights; None = bfloat16 on CUDA (the fused expert kernels' dtype), float32
    on CPU. target_dtype: the target's weights (float32 by default: the standalone target checks
    losslessness against its own greedy decode, which bf16 batched verify does not reproduce bit
    for bit). show: rank 0 prints (and writes) the first `show` requests' generations.
    output: rank 0 writes every prompt's tokens here (JSON lines, the prompts file's order).
    sampling: every prompt's defaults (a prompts line's own fields override them; no seed: see
    `seed`). seed: the run's seed; a prompt without its own gets `seeded(..., seed, its index)`.
    master_addr: the host of node 0 the launcher gave torchrun (`--master-addr`); loopback means
    every rank is on this host, so paired ranks reach each other there (disaggregated placement).
    """

    draft: str
    target: str
    prompts: str
    max_new_tokens: int = 64
    max_prompts: int = 0
    check_lossless: bool = True
    json_out: str | None = None
    output: str | None = None
    show: int = 0
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    target_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    master_addr: str = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class RankSetup:
    """What every rank of a run derives once, before loading anything.

    prompts: the run's prompts (request id = index), each with its seed resolved (`run_prompts`).
    """

    spec: DraftModelSpec
    prompts: list[Prompt]
    device: torch.device
    dtype: torch.dtype
    target_dtype: torch.dtype


def rank_setup(pc: ParallelConfig, config_path: str, job: RunJob) -> RankSetup:
    """Read the draft's spec (its config.json, once) and the prompts; resolve device and dtypes.

    Raises ConfigError naming target.tp in `config_path` when the config asks for a sharded target
    (`epdraft run` refuses it before any rank starts; a worker started some other way, here).
    """
    check_standalone_target(pc, source=config_path)
    device_type, _ = resolve_backend(pc)
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    return RankSetup(
        spec=read_draft_spec(job.draft),
        prompts=run_prompts(job),
        device=device,
        dtype=getattr(torch, job.dtype) if job.dtype else default_dtype(device),
        target_dtype=getattr(torch, job.target_dtype),
    )


def run_prompts(job: RunJob) -> list[Prompt]:
    """The job's prompts (the first `max_prompts`), each sampled as `seeded(its params, job.seed,
    its index)`: the same on every rank, so the target's and the draft's sides of a request draw
    the same stream wherever it runs."""
    prompts = read_prompt_file(job.prompts, defaults=job.sampling, limit=job.max_prompts, tokenizer_dir=job.target)
    return [msgspec.structs.replace(p, sampling=seeded(p.sampling, job.seed, i)) for i, p in enumerate(prompts)]


def pool_limits(
    pc: ParallelConfig, job: RunJob, prompts: list[Prompt], shares: list[list[int]], block_size: int
) -> dict:
    """The KV pool every draft rank sizes alike when `shares` are the DP ranks' prompt indices: the
    config's limits, or what the run needs (the largest share at once, each request to its prompt
    + max_new_tokens + one block of rows). Alike on every rank, because the CUDA-graph buckets
    follow `max_requests` and every rank must hold the bucket of the busiest one."""
    longest = max((len(prompts[i].ids) for share in shares for i in share), default=0)
    return {
        "max_requests": pc.draft.max_requests or max(1, max(map(len, shares), default=0)),
        "max_context": pc.draft.max_context or longest + job.max_new_tokens + block_size,
    }


def run_job(
    pc: ParallelConfig, config_path: str, groups: Groups | None, job: RunJob, watchdog: Watchdog
) -> str | None:
    """Serve the job's prompts on a colocated rank; rank 0 prints (and writes) the summary.

    The report's start-up time is this rank's from here to serving (the target and draft loaded,
    the runtime built, the step's CUDA graphs captured), apart from the serving wall time the
    throughput divides by.

    `watchdog`: this rank's, told each phase (a stalled peer is named with its last one).
    Returns, on rank 0, why the run failed although every rank finished (the lossless check, no
    token generated); None otherwise.
    """
    assert groups is not None, "a colocated rank always holds the draft"
    started = time.perf_counter()
    watchdog.progress(phase="reading the draft config and prompts")
    setup = rank_setup(pc, config_path, job)
    spec = setup.spec
    display = Progress.for_rank(dist.get_rank())
    display.phase("loading the target")
    watchdog.progress(phase="loading the target")
    target = HFTarget.from_pretrained(job.target, spec.target_layer_ids, dtype=setup.target_dtype, device=setup.device)
    check_against_target(
        spec, hidden_size=target.hidden_size, num_layers=target.num_layers, vocab_size=target.vocab_size
    )
    timers = PhaseTimers(setup.device)
    prompts = setup.prompts
    shares = assign_prompts([len(p.ids) for p in prompts], job.max_new_tokens, groups.dp_size)
    mine = shares[groups.dp_rank]
    display.phase("loading the draft")
    watchdog.progress(phase="loading the draft")
    runtime = DraftRuntime.from_config(
        pc, job.draft, target, groups=groups, spec=spec, dtype=setup.dtype, device=setup.device, num_extras=2,
        timers=timers, watchdog=watchdog, **pool_limits(pc, job, prompts, shares, spec.block_size),
    )  # fmt: skip
    if runtime.graphs is not None:
        display.phase("capturing the draft step's CUDA graphs", len(runtime.graphs.buckets), "buckets")
        runtime.warm_up(display.update)
    # Every rank starts serving together: a rank that loaded first would otherwise book its wait
    # for the others as step sync, and the ranks' wall times (which the phases split) would differ.
    dist.barrier(group=groups.cpu)
    startup = timers.now() - started
    try:
        log.debug("%d of %d prompts on this rank", len(mine), len(prompts))  # the summary has every rank's count
        report = serve_requests(
            target,
            LocalDrafter(runtime),
            {i: prompts[i] for i in mine},
            rank=dist.get_rank(),
            max_new_tokens=job.max_new_tokens,
            timers=timers,
            watchdog=watchdog,
            display=display,
            total_tokens=len(prompts) * job.max_new_tokens,
        )
        report.layout, report.kernels = runtime.layout.label, runtime.kernels.label
        report.startup_seconds = startup
    finally:
        runtime.close()
    root = dist.get_process_group_ranks(groups.cpu)[0]
    return finish(report, target, job, pc, config_path, setup.prompts, group=groups.cpu, root=root,
                  watchdog=watchdog, display=display)  # fmt: skip


def finish(
    report: RankReport,
    target: HFTarget | None,
    job: RunJob,
    pc: ParallelConfig,
    config_path: str,
    prompts: list[Prompt],
    *,
    group: dist.ProcessGroup | None,
    root: int,
    select: Callable[[list[RankReport]], list[RankReport]] = lambda reports: reports,
    watchdog: Watchdog,
    display: Progress | None = None,
) -> str | None:
    """Attach the target's own greedy decodes to the greedy requests (on ranks holding the target),
    then report to `root`. A sampled request is not compared: its tokens are one draw of the
    target's distribution (exact in distribution, which tests/e2e/test_sampling_exact.py checks)."""
    display = display if display is not None else Progress(None)
    watchdog.progress(phase="lossless check")
    if target is not None and job.check_lossless:
        checked = [o for o in report.requests if o.error is None and o.sampling.greedy]
        display.phase("lossless check (this rank's greedy requests)", len(checked), "requests")
        for n, o in enumerate(checked):
            o.reference_tokens = greedy_reference(target.model, prompts[o.request_id].ids, job.max_new_tokens)
            display.update(n + 1)
    display.close()
    watchdog.progress(phase="reporting to rank 0")
    return report_to_root(report, job, pc, config_path, prompts, group=group, root=root, select=select)


def report_to_root(
    report: RankReport,
    job: RunJob,
    pc: ParallelConfig,
    config_path: str,
    prompts: list[Prompt],
    *,
    group: dist.ProcessGroup | None,
    root: int,
    select: Callable[[list[RankReport]], list[RankReport]],
) -> str | None:
    """Gather every rank's report on `root` (a global rank of `group`), which prints the summary
    (and writes it as JSON, and every prompt's output, when asked); `select` picks and merges the
    reports that make it.

    Returns, on the root, why the run failed: the lossless check, or nothing generated (every
    request refused is no success); None otherwise.
    """
    is_root = dist.get_rank() == root
    gathered: list[bytes | None] | None = [None] * dist.get_world_size(group) if is_root else None
    dist.gather_object(msgspec.msgpack.encode(report), gathered, dst=root, group=group)
    if not is_root:
        return None
    reports = select([msgspec.msgpack.decode(b, type=RankReport) for b in gathered])
    summary = summarize(reports, config=config_path, parallel_config=pc.to_dict())
    if job.show:
        summary.shown = generations(reports, job.show, tokenizer_dir=job.target)
    print(format_summary(summary), flush=True)
    if job.json_out:
        Path(job.json_out).write_bytes(msgspec.json.format(msgspec.json.encode(summary)) + b"\n")
    if job.output:
        write_outputs(job.output, prompts, [o for r in reports for o in r.requests], tokenizer_dir=job.target)
    if summary.lossless is False:
        return f"lossless check failed: {summary.first_mismatch} from the target's own greedy decode"
    if summary.generated_tokens == 0:
        return f"nothing was generated: {len(summary.failed_requests)} of {summary.requests} requests were refused"
    return None
