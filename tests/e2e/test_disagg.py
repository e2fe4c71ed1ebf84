"""Disaggregated drafts end to end: `epdraft run configs/local-cpu-disagg.toml` (node 0 target, node 1 draft).

The draft's MoE output decides the accept length, so a disaggregated run that drafts the same
requests with the same experts must accept exactly what the colocated run on the same prompts
accepts; both must equal the target's own greedy decode (then their tokens are equal too).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from epdraft.config.parallel import load_parallel_config, parallel_config_from_dict
from epdraft.worker.pairing import paired_draft_rank, paired_target_ranks
from tests.e2e.faulty_run import processes_with, run_with_fault
from tests.e2e.test_run import run_epdraft

KILL_AT_STEP_ENV = "EPDRAFT_TEST_KILL_DRAFT_AT"  # read by tests/e2e/faults/sitecustomize.py

REPO = Path(__file__).resolve().parents[2]
DISAGG = "configs/local-cpu-disagg.toml"
PROMPTS = ["--max-prompts", "5", "--max-new-tokens", "32"]
# Many-to-one: two target nodes of one rank each share the one draft rank on node 2.
TWO_TARGETS_ONE_DRAFT = [
    "--set", "cluster.nnodes=3", "--set", "cluster.nproc_per_node=1", "--set", "draft.attn_dp=1",
    "--set", "draft.moe_layout=replicated", "--set", "draft.moe_ep=1", "--set", "placement.draft_nodes=[2]",
]  # fmt: skip


def test_pairing_is_target_dp_rank_modulo_draft_ranks():
    pc = parallel_config_from_dict({
        "cluster": {"nnodes": 3, "nproc_per_node": 2, "device": "cpu"},
        "draft": {"attn_dp": 2},
        "target": {"dp": 4},
        "placement": {"mode": "disaggregated", "draft_nodes": [1]},
    })  # fmt: skip
    assert pc.target_ranks == (0, 1, 4, 5) and pc.draft_ranks == (2, 3)
    assert [paired_draft_rank(pc, t) for t in pc.target_ranks] == [2, 3, 2, 3]
    assert paired_target_ranks(pc, 2) == (0, 4) and paired_target_ranks(pc, 3) == (1, 5)
    local = load_parallel_config(REPO / DISAGG)
    assert [paired_draft_rank(local, t) for t in local.target_ranks] == [2, 3]


@pytest.mark.timeout(600)
def test_disaggregated_run_equals_colocated(tmp_path):
    # local-cpu-2 is the same draft layout (attn_dp 2, alltoall over moe_ep 2) with the draft beside the target.
    (tmp_path / "colocated").mkdir()
    (tmp_path / "disagg").mkdir()
    colocated_proc, colocated = run_epdraft(PROMPTS, tmp_path / "colocated")
    assert colocated_proc.returncode == 0, colocated_proc.stdout + colocated_proc.stderr
    proc, disagg = run_epdraft([DISAGG, *PROMPTS], tmp_path / "disagg")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "draft DP rank 1 serves target ranks [1]" in proc.stderr
    for summary in (colocated, disagg):
        assert summary["lossless"] is True and summary["requests"] == 5 and not summary["failed_requests"]
    for key in ("accept_length", "verify_steps", "accept_length_per_rank", "requests_per_rank", "generated_tokens"):
        assert disagg[key] == colocated[key], key
    assert disagg["accept_length"] >= 2.0


@pytest.mark.timeout(420)
def test_one_draft_rank_serves_two_target_ranks(tmp_path):
    proc, summary = run_epdraft([DISAGG, *TWO_TARGETS_ONE_DRAFT, *PROMPTS], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "draft DP rank 0 serves target ranks [0, 1]" in proc.stderr
    assert summary["lossless"] is True and summary["requests"] == 5
    assert summary["accept_length"] >= 2.0


@pytest.mark.timeout(300)
def test_killed_draft_rank_fails_every_rank_naming_it(tmp_path):
    timeout_s = 30
    run = run_with_fault({KILL_AT_STEP_ENV: "3:5"},
                         [DISAGG, *PROMPTS, "--no-lossless-check", "--set", f"cluster.timeout_s={timeout_s}"],
                         f"{KILL_AT_STEP_ENV}: killing this rank at step 5")  # fmt: skip
    log = run.stderr
    assert run.seen_at is not None, log
    assert run.ended_at - run.seen_at <= timeout_s + 30, log
    assert run.returncode != 0, log
    # One line names it: node 1's torchrun, whose rank it was, usually fails first (its record of
    # the SIGKILL), else the target rank paired with it wrote why it failed first.
    last = log.strip().splitlines()[-1]
    named = ("epdraft run: rank 3 (node 1, pid ", "epdraft run: draft rank 3 stopped answering at step 5")
    assert last.startswith(named), log
    assert "ChildFailedError" not in log, log
    assert processes_with(run.marker) == [], log
