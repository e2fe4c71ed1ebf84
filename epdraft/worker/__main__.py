"""`python -m epdraft.worker --config CONFIG [--set k=v ...]`: one rank of a draft deployment.

torchrun (built by `epdraft launch`) starts one of these per rank. It loads the parallel config,
initializes the process group bounded by `cluster.timeout_s`, builds the Groups, logs the layout
from rank 0, checks every group with an all-reduce and tears the process group down.

A rank that dies of a signal prints every thread's Python stack; `kill -USR1 PID` prints them from
a rank that hangs and lets it run on. Every rank runs a `Watchdog` from init to teardown: a peer
without a heartbeat for `cluster.hang_timeout_s`, or whose main thread is stuck that long while this
rank waits on it in a collective, makes this rank exit 1 naming it, and a collective that fails
because a peer died becomes a ParallelError naming the peer, the step and the phase.

A failing rank exits 2 when it refused its input (config, draft, target, prompts) and 1 for a
fault; with `--failure-dir` (the launcher's) it first writes its one-line reason there, so the
launcher prints the first rank's reason once instead of every rank's log and torchrun's traceback.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import logging
import os
import signal
import sys

import msgspec
import torch
import torch.distributed as dist

from epdraft.config.parallel import ParallelConfig, load_parallel_config
from epdraft.config.sampling import SamplingParams, parse_sampling
from epdraft.errors import EpdraftError, NonFiniteError, ParallelError
from epdraft.parallel.groups import Groups, layout_table, resolve_backend
from epdraft.parallel.health import check_all_reduce, health_check
from epdraft.parallel.failure import write_failure, write_progress
from epdraft.parallel.log import info_rank0, setup_logging
from epdraft.parallel.watchdog import Watchdog
from epdraft.parallel.world import join_world, leave_world
from epdraft.worker.disagg_job import run_disaggregated_job
from epdraft.worker.job import RunJob, run_job

log = logging.getLogger("epdraft.worker")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m epdraft.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="parallel config (.toml, .yaml or .json)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key, e.g. draft.moe_ep=2"
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    parser.add_argument("--failure-dir", help="a failing rank writes its one-line reason here (the launcher's folder)")
    job = parser.add_argument_group("run job (without --draft the worker only checks the layout)")
    job.add_argument("--draft", help="draft export directory (config.json + safetensors)")
    job.add_argument("--target", help="HF target model directory")
    job.add_argument("--prompts", help='JSON-lines prompts, {"input_ids": [...]} or {"text": "..."} per line, each '
                     'optionally with its own "temperature", "top_k", "top_p", "seed" and an "id"')
    job.add_argument("--max-new-tokens", type=int, default=64)
    job.add_argument("--max-prompts", type=int, default=0, help="use only the first N prompts (0 = all)")
    job.add_argument("--no-lossless-check", action="store_true", help="skip the target-only greedy reference decode")
    job.add_argument("--json", dest="json_out", help="rank 0 writes the summary here as JSON")
    job.add_argument("--output", help="rank 0 writes one JSON line per prompt here, in the prompts file's order")
    job.add_argument("--temperature", type=float, default=0.0, help="every prompt's default temperature (0 = greedy)")
    job.add_argument("--top-k", type=int, default=None, help="every prompt's default top-k (default: none)")
    job.add_argument("--top-p", type=float, default=1.0, help="every prompt's default top-p (default 1)")
    job.add_argument("--seed", type=int, default=0, help="the run's seed, from which unseeded prompts' seeds derive")
    job.add_argument("--show", type=int, default=0, help="rank 0 prints the first N requests' generated text")
    job.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                     help="the draft's weights (default: bfloat16 on CUDA, float32 on CPU)")
    job.add_argument("--target-dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                     help="the target's weights (default float32)")
    job.add_argument("--master-addr", default="127.0.0.1",
                     help="host of node 0, as the launcher gave torchrun (loopback: every rank is on this host)")
    args = parser.parse_args(argv)
    if args.draft and not (args.target and args.prompts):
        parser.error("--draft needs --target and --prompts")
    return args


def job_sampling(args: argparse.Namespace) -> tuple[SamplingParams, int]:
    """(every prompt's default sampling, the run's seed) from the flags; ConfigError naming the field
    for a value out of range (`epdraft run` refuses it earlier naming the flag; a worker started
    some other way is checked here)."""
    fields = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed}
    checked = parse_sampling(fields, "python -m epdraft.worker --temperature/--top-k/--top-p/--seed")
    return msgspec.structs.replace(checked, seed=None), args.seed


def init_distributed(pc: ParallelConfig) -> None:
    """Join the world torchrun set up (env://), with the config's backend and timeout."""
    device_type, backend = resolve_backend(pc)
    device_id = None
    if device_type == "cuda":
        # LOCAL_RANK is torchrun's contract with the processes it starts.
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise ParallelError(
                f"local rank {local_rank} has no GPU: this host has {torch.cuda.device_count()}, "
                f"cluster.nproc_per_node = {pc.cluster.nproc_per_node}"
            )
        torch.cuda.set_device(local_rank)
        device_id = torch.device("cuda", local_rank)
    join_world(backend, timeout=datetime.timedelta(seconds=pc.cluster.timeout_s), device_id=device_id)


def run(pc: ParallelConfig, config_path: str, watchdog: Watchdog, job: RunJob | None = None) -> str | None:
    """Everything between init and teardown: groups, layout, health check, then the job if any.

    Returns why the job failed although every rank finished (rank 0: lossless check, no tokens), else None.
    """
    watchdog.progress(phase="groups and health check")
    # The config and layout at DEBUG: the summary's first line names the config, its ranks and layout.
    info_rank0(log, None, "parallel config %s: %s", config_path, json.dumps(pc.to_dict()), level=logging.DEBUG)
    groups = Groups.from_config(pc)
    info_rank0(log, None, "layout:\n%s", layout_table(pc), level=logging.DEBUG)
    if groups is None:
        log.debug("target-only rank: holds no draft")
    else:
        log.debug(
            "draft rank: attn_dp %d/%d, moe_ep %d/%d, moe_tp %d/%d",
            groups.dp_rank, groups.dp_size, groups.ep_rank, groups.ep_size, groups.tp_rank, groups.tp_size,
        )
    check_all_reduce(dist.group.WORLD, "world")
    if groups is not None:
        health_check(groups)
    info_rank0(log, None, "health check passed on %d ranks", dist.get_world_size())
    if job is None:
        return None
    if pc.placement.mode == "disaggregated":
        return run_disaggregated_job(pc, config_path, groups, job, watchdog)
    return run_job(pc, config_path, groups, job, watchdog)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level)
    if args.draft and args.log_level.upper() != "DEBUG":
        _quiet_progress_bars()
    # A rank killed by a signal (SIGSEGV, or SIGABRT from C++) prints every thread's Python stack,
    # and `kill -USR1 PID` prints them from a rank that hangs, without stopping it.
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    watchdog: Watchdog | None = None
    try:
        pc = load_parallel_config(args.config, args.set)
        init_distributed(pc)
        try:
            watchdog = Watchdog.start_for(
                dist.group.WORLD,
                hang_timeout_s=pc.cluster.hang_timeout_s,
                on_stall=lambda reason: _exit_stalled(args.failure_dir, reason, watchdog),
                stacks_on_usr1=True,
                on_progress=(lambda step, phase: write_progress(args.failure_dir, dist.get_rank(), step, phase))
                if args.failure_dir else None,
            )
            job = None
            if args.draft:
                defaults, run_seed = job_sampling(args)
                job = RunJob(
                    draft=args.draft,
                    target=args.target,
                    prompts=args.prompts,
                    max_new_tokens=args.max_new_tokens,
                    max_prompts=args.max_prompts,
                    check_lossless=not args.no_lossless_check,
                    json_out=args.json_out,
                    output=args.output,
                    sampling=defaults,
                    seed=run_seed,
                    show=args.show,
                    dtype=args.dtype,
                    target_dtype=args.target_dtype,
                    master_addr=args.master_addr,
                )
            failed = run(pc, args.config, watchdog, job)
        except BaseException as e:
            code, reason = _failure(e, watchdog)
            if watchdog is not None:
                watchdog.fail(reason)
            if code is None:
                raise
            return _fail(args.failure_dir, code, reason)
        finally:
            if watchdog is not None:
                watchdog.stop()
            leave_world()
    except EpdraftError as e:  # before the world exists: the config, init
        return _fail(args.failure_dir, 1 if isinstance(e, ParallelError) else 2, str(e))
    return 0 if failed is None else _fail(args.failure_dir, 1, failed)


def _quiet_progress_bars() -> None:
    """Turn off transformers' "Loading weights" bars: every rank draws its own on stderr, interleaved
    with the others'; `--log-level DEBUG` keeps them. Its warnings and errors still print."""
    import transformers.utils.logging

    transformers.utils.logging.disable_progress_bar()


def _failure(e: BaseException, watchdog: Watchdog | None) -> tuple[int | None, str]:
    """(exit code, one-line reason) of a failed run; exit code None: not ours to handle (re-raise).

    2 for refused input, 1 for a fault. A torch error of a collective whose peer died or stalled
    becomes the watchdog's ParallelError naming that peer.
    """
    if isinstance(e, (ParallelError, NonFiniteError)):
        return 1, str(e)
    if isinstance(e, EpdraftError):
        return 2, str(e)
    if isinstance(e, RuntimeError) and watchdog is not None and (lost := watchdog.lost_error(e)) is not None:
        return 1, str(lost)
    if isinstance(e, Exception):
        log.exception("worker failed")
        return 1, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}".rstrip(": ")
    return None, f"{type(e).__name__}"


def _fail(failure_dir: str | None, code: int, reason: str) -> int:
    """Write the reason for the launcher first (it mutes what follows), then log it; return `code`."""
    if failure_dir:
        write_failure(failure_dir, dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0")),
                      code, reason)  # fmt: skip
    log.error("%s", reason)
    return code


def _exit_stalled(failure_dir: str | None, reason: str, watchdog: Watchdog) -> None:
    """The watchdog named a stalled or stuck peer: exit now. The main thread is stuck in a collective
    with that peer until `cluster.timeout_s`, so the process ends from the watchdog's thread, once
    its peers have the verdict too (they are stopped with it, and would otherwise name nobody)."""
    _fail(failure_dir, 1, reason)
    watchdog.await_verdicts()
    logging.shutdown()
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
