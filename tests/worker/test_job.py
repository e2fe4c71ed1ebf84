"""The run job on each rank: the draft's config.json is read once and the planner runs once, per rank."""

from __future__ import annotations

import builtins
import pathlib
from pathlib import Path
from unittest import mock

import pytest

from tests.harness import run_ranks

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "epdraft" / "assets"


def _counted_job(rank: int, world: int, layout: str) -> dict:
    from epdraft.config.parallel import load_parallel_config
    from epdraft.dispatch import planner
    import torch.distributed as dist

    from epdraft.parallel.groups import Groups
    from epdraft.parallel.watchdog import Watchdog
    from epdraft.worker.job import RunJob, run_job

    pc = load_parallel_config(REPO / "configs" / "local-cpu-2.toml", [f"draft.moe_layout={layout}"])
    groups = Groups.from_config(pc)
    draft_config = (ASSETS / "tiny-draft" / "config.json").resolve()
    reads = {"config.json": 0, "planner": 0}

    def counting(original):
        def wrapper(self_or_file, *args, **kwargs):
            if Path(self_or_file).resolve() == draft_config:
                reads["config.json"] += 1
            return original(self_or_file, *args, **kwargs)

        return wrapper

    choose = planner.choose_for_config

    def counted_choose(*args, **kwargs):
        reads["planner"] += 1
        return choose(*args, **kwargs)

    job = RunJob(
        draft=str(ASSETS / "tiny-draft"), target=str(ASSETS / "tiny-target"), prompts=str(ASSETS / "prompts.jsonl"),
        max_new_tokens=4, max_prompts=3, check_lossless=False,
    )  # fmt: skip
    with (
        mock.patch.object(pathlib.Path, "read_bytes", counting(pathlib.Path.read_bytes)),
        mock.patch.object(pathlib.Path, "read_text", counting(pathlib.Path.read_text)),
        mock.patch.object(builtins, "open", counting(builtins.open)),
        mock.patch.object(planner, "choose_for_config", counted_choose),
    ):
        watchdog = Watchdog.start_for(dist.group.WORLD, hang_timeout_s=pc.cluster.hang_timeout_s)
        try:
            assert run_job(pc, "local-cpu-2.toml", groups, job, watchdog) is None
        finally:
            watchdog.stop()
    return reads


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,planner_runs", [("auto", 1), ("alltoall", 0)])
def test_draft_config_read_once_and_planner_once_per_rank(layout, planner_runs):
    counts = run_ranks(2, _counted_job, layout, timeout_s=200)
    assert counts == [{"config.json": 1, "planner": planner_runs}] * 2


def test_run_prompts_resolve_each_seed_from_the_run_seed_and_the_prompt_index(tmp_path):
    import json

    from epdraft.config.sampling import SamplingParams
    from epdraft.sampling.batch import request_seed
    from epdraft.worker.job import RunJob, run_prompts

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in
                               [{"input_ids": [1]}, {"input_ids": [2], "seed": 5}, {"input_ids": [3]}]))  # fmt: skip
    job = RunJob(draft="d", target=str(tmp_path), prompts=str(prompts), max_prompts=2, seed=9,
                 sampling=SamplingParams(temperature=0.5))  # fmt: skip
    resolved = run_prompts(job)
    assert [p.sampling for p in resolved] == [SamplingParams(temperature=0.5, seed=request_seed(9, 0)),
                                              SamplingParams(temperature=0.5, seed=5)]  # fmt: skip
    assert run_prompts(job) == resolved  # every rank resolves the same seeds


def test_the_worker_refuses_sampling_flags_out_of_range():
    from epdraft.errors import ConfigError
    from epdraft.worker.__main__ import job_sampling, parse_args

    base = ["--config", "c.toml", "--draft", "d", "--target", "t", "--prompts", "p"]
    defaults, seed = job_sampling(parse_args([*base, "--temperature", "0.7", "--top-k", "3", "--seed", "4"]))
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.seed, seed) == (0.7, 3, 1.0, None, 4)
    with pytest.raises(ConfigError, match=r"--top-p/--seed: top_p = 1.5: expected `float` <= 1.0"):
        job_sampling(parse_args([*base, "--top-p", "1.5"]))


def test_every_rank_sizes_its_pool_for_the_busiest_rank():
    """Uneven shares (3 prompts and 1): both ranks size max_requests 3, so both hold the CUDA-graph
    bucket the busiest rank's steps need; the context fits the longest prompt of any share."""
    from epdraft.config.parallel import load_parallel_config
    from epdraft.config.sampling import SamplingParams
    from epdraft.target.prompts import Prompt
    from epdraft.worker.job import RunJob, pool_limits

    pc = load_parallel_config(REPO / "configs" / "local-cpu-2.toml")
    job = RunJob(draft="d", target="t", prompts="p", max_new_tokens=10)
    prompts = [Prompt(line=i + 1, ids=[1] * n, sampling=SamplingParams()) for i, n in enumerate((5, 7, 3, 40))]
    assert pool_limits(pc, job, prompts, [[0, 1, 2], [3]], 8) == {"max_requests": 3, "max_context": 40 + 10 + 8}
    assert pool_limits(pc, job, prompts, [[], []], 8) == {"max_requests": 1, "max_context": 0 + 10 + 8}
    fixed = load_parallel_config(REPO / "configs" / "local-cpu-2.toml", ["draft.max_requests=16",
                                                                          "draft.max_context=99"])
    assert pool_limits(fixed, job, prompts, [[0], [1]], 8) == {"max_requests": 16, "max_context": 99}
