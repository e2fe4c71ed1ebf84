"""`epdraft run` end to end on CPU ranks: lossless, and the tiny pair's acceptance holds in every layout.

A wrong dispatch or combine corrupts the draft's MoE output, which collapses the accept length
(tokens per verify step, bonus included) toward 1 while staying lossless (the target decides), so acceptance is the check
that the distributed MoE computes the right thing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.harness import free_port

CASES = {
    "1rank-replicated": ["--set", "cluster.nproc_per_node=1", "--set", "draft.attn_dp=1", "--set", "target.dp=1",
                         "--set", "draft.moe_layout=replicated", "--set", "draft.moe_ep=1"],
    "2rank-replicated": ["--set", "draft.moe_layout=replicated", "--set", "draft.moe_ep=1"],
    "2rank-alltoall": [],
    "2rank-auto": ["--set", "draft.moe_layout=auto"],
    "2rank-gather-sum_len": ["--set", "draft.moe_layout=gather", "--set", "draft.dp_padding=sum_len"],
    "4rank-replicated": ["configs/local-cpu-4.toml", "--set", "draft.moe_layout=replicated",
                         "--set", "draft.moe_ep=1", "--set", "draft.moe_tp=1"],
    "4rank-alltoall-ep4": ["configs/local-cpu-4.toml", "--set", "draft.moe_layout=alltoall",
                           "--set", "draft.moe_ep=4", "--set", "draft.moe_tp=1"],
    "4rank-gather-ep2-tp2": ["configs/local-cpu-4.toml", "--set", "draft.moe_layout=gather",
                             "--set", "draft.moe_ep=2", "--set", "draft.moe_tp=2"],
}


def run_epdraft(args: list[str], tmp_path, timeout: float = 400) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "epdraft.cli", "run", *args, "--json", str(out), "--master-port", str(free_port())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def _env():
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", list(CASES))
def test_run_is_lossless_and_accepts(case, tmp_path):
    # 5 prompts over 4 ranks (or 2): counts are uneven, so ranks go idle at different steps.
    proc, summary = run_epdraft([*CASES[case], "--max-prompts", "5", "--max-new-tokens", "32"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary is not None and summary["lossless"] is True, proc.stdout
    assert summary["requests"] == 5 and not summary["failed_requests"]
    assert summary["accept_length"] >= 2.0, proc.stdout
    assert "lossless: OK" in proc.stdout
    check_time_split(summary, proc.stdout)


def check_time_split(summary: dict, stdout: str) -> None:
    """The phase rows are disjoint and sum, with "other", to the run's wall time (within 5 %);
    "other" (time outside every phase) is no negative remainder hiding double-booked phases, and
    small: the phases cover the run. Start-up is reported apart from the throughput's wall."""
    phases, wall = summary["phase_seconds"], summary["seconds"]
    assert all(v >= 0.0 for v in phases.values()), phases
    assert abs(sum(phases.values()) - wall) <= 0.05 * wall, (phases, wall)
    assert 0.0 <= phases["other"] <= 0.25 * wall, (phases, wall)
    assert phases["verify"] > 0 and phases["prefill"] > 0 and phases["draft_attention"] > 0, phases
    assert summary["tokens_per_s"] == summary["generated_tokens"] / wall
    assert summary["startup_seconds"] > 0
    assert f"start-up: {summary['startup_seconds']:.2f} s" in stdout


@pytest.mark.timeout(300)
def test_default_run_logs_at_most_five_lines_and_prints_the_summary():
    """The default run's stderr at the default log level: no torchrun command or banner, no
    progress bars, no per-rank lines; `--log-level DEBUG` shows them. The summary is stdout's."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torchrun's banner shows when unset
    base = [sys.executable, "-m", "epdraft.cli", "run", "--max-prompts", "2", "--max-new-tokens", "8"]
    proc = subprocess.run([*base, "--master-port", str(free_port())], capture_output=True, text=True, timeout=240,
                          env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(proc.stderr.splitlines()) <= 5, proc.stderr
    assert proc.stdout.startswith("epdraft run: ") and "lossless: OK" in proc.stdout, proc.stdout
    debug = subprocess.run([*base, "--log-level", "DEBUG", "--show", "2", "--master-port", str(free_port())],
                           capture_output=True, text=True, timeout=240, env=env)  # fmt: skip
    assert debug.returncode == 0, debug.stdout + debug.stderr
    for detail in ("torch.distributed.run", "parallel config", "draft rank: attn_dp 1/2", "Loading weights"):
        assert detail in debug.stderr, debug.stderr
    # The tiny target's byte tokenizer: --show prints text, not ids.
    assert "request 0 (rank 0): '" in debug.stdout and "token ids" not in debug.stdout, debug.stdout


@pytest.mark.timeout(300)
def test_bad_requests_are_refused_and_the_others_finish(tmp_path):
    good = [json.loads(line)["input_ids"] for line in open("epdraft/assets/prompts.jsonl")][:3]
    lines = [{"input_ids": good[0]}, {"input_ids": []}, {"input_ids": good[1] + [100000]}, {"input_ids": good[2]}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    proc, summary = run_epdraft(["--prompts", str(prompts), "--max-new-tokens", "16"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary["lossless"] is True
    assert summary["requests"] == 4
    assert set(summary["failed_requests"]) == {"1", "2"}
    assert "request 1: empty prompt" in summary["failed_requests"]["1"]
    assert "token id 100000 outside the vocabulary" in summary["failed_requests"]["2"]
    assert summary["generated_tokens"] == 2 * 16


@pytest.mark.timeout(60)
def test_draft_whose_config_contradicts_its_weights_is_refused_before_any_rank(tmp_path):
    import shutil

    draft = tmp_path / "draft"
    shutil.copytree("epdraft/assets/tiny-draft", draft)
    config = json.loads((draft / "config.json").read_text())
    config["hidden_size"] = 2 * config["hidden_size"]
    (draft / "config.json").write_text(json.dumps(config))
    proc, summary = run_epdraft(["--draft", str(draft), "--max-prompts", "2", "--max-new-tokens", "8"], tmp_path, 50)
    assert proc.returncode == 2 and summary is None
    assert proc.stderr == f"epdraft run: {draft}: fc.weight: expected shape [256, 512], found [128, 256]\n", proc.stderr
    assert not proc.stdout


@pytest.mark.timeout(200)
def test_a_worker_whose_every_request_is_refused_exits_non_zero(tmp_path):
    """Past the launcher's preflight (an engine may start the worker itself): 0 tokens is no success."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input_ids": []}\n{"input_ids": [100000]}\n')
    one_rank = ["--set", "cluster.nproc_per_node=1", "--set", "draft.attn_dp=1", "--set", "target.dp=1",
                "--set", "draft.moe_layout=replicated", "--set", "draft.moe_ep=1"]  # fmt: skip
    env = {**_env(), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}  # fmt: skip
    cmd = [sys.executable, "-m", "epdraft.worker", "--config", "configs/local-cpu-2.toml", *one_rank,
           "--draft", "epdraft/assets/tiny-draft", "--target", "epdraft/assets/tiny-target", "--prompts", str(prompts)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "requests: 2 (2 refused)" in proc.stdout, proc.stdout
    assert "nothing was generated: 2 of 2 requests were refused" in proc.stderr, proc.stderr


@pytest.mark.timeout(420)
@pytest.mark.parametrize("fmt, layout, trained", [("mxfp4", "per-expert", True), ("fp8", "fused", True),
                                                  ("mxfp4", "fused", False)])
def test_run_quantized_draft_dequantized_at_load(fmt, layout, trained, tmp_path):
    """A tiny quantized draft (tools/make_tiny_quant_draft.py: random weights, or the trained tiny draft's),
    experts over 2 ranks: dequantized at load, said in one log line (rank 0's), lossless, and quantizing the
    trained draft keeps its acceptance."""
    draft = tmp_path / "draft"
    weights = ["--weights", "epdraft/assets/tiny-draft"] if trained else []
    made = subprocess.run([sys.executable, "tools/make_tiny_quant_draft.py", "--format", fmt, "--layout", layout,
                           *weights, "--out", str(draft)], capture_output=True, text=True, timeout=120, env=_env())
    assert made.returncode == 0, made.stderr
    proc, summary = run_epdraft(["--draft", str(draft), "--max-prompts", "5", "--max-new-tokens", "32"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary is not None and summary["lossless"] is True, proc.stdout
    assert summary["accept_length"] >= (2.0 if trained else 1.0), proc.stdout
    logged = [line for line in (proc.stdout + proc.stderr).splitlines() if "dequantized to float32 at load" in line]
    assert len(logged) == 1 and all(f"{fmt} checkpoint dequantized" in line for line in logged), logged


@pytest.mark.timeout(600)
def test_sampled_run_writes_every_prompt_and_repeats_with_the_same_seeds(tmp_path):
    """--temperature 0.8 with a greedy line and a line of its own sampling: every prompt's output,
    in order, of the right length; the same seeds give the same file twice (counter-based random
    numbers: a request's tokens depend on its seed, never its rank or batch); the greedy request is
    still lossless-checked, the sampled ones get a per-setting row."""
    good = [json.loads(line)["input_ids"] for line in open("epdraft/assets/prompts.jsonl")][:5]
    lines = [{"input_ids": good[0], "id": "a"}, {"input_ids": good[1], "temperature": 0, "id": 2},
             {"input_ids": good[2], "top_k": 5, "seed": 123}, {"input_ids": []}, {"input_ids": good[3]},
             {"input_ids": good[4], "temperature": 1.2, "top_p": 0.9}]  # fmt: skip
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    files = []
    for attempt in range(2):
        out = tmp_path / f"out{attempt}.jsonl"
        flags = ["--prompts", str(prompts), "--max-new-tokens", "16", "--temperature", "0.8", "--seed", "7",
                 "--output", str(out)]  # fmt: skip
        proc, summary = run_epdraft(flags, tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        written = [json.loads(line) for line in out.read_text().splitlines()]
        assert [w["index"] for w in written] == list(range(6))
        assert [w["id"] for w in written] == ["a", 2, None, None, None, None]
        assert [len(w["output_ids"]) for w in written] == [16, 16, 16, 0, 16, 16]
        assert "empty prompt" in written[3]["error"] and all("error" not in w for i, w in enumerate(written) if i != 3)
        assert [w["temperature"] for w in written] == [0.8, 0.0, 0.8, 0.8, 0.8, 1.2]
        assert written[2]["seed"] == 123 and written[2]["top_k"] == 5 and written[5]["top_p"] == 0.9
        assert summary["sampled_requests"] == 4 and summary["lossless"] is True and summary["lossless_requests"] == 1
        assert [row["label"] for row in summary["per_sampling"]] == ["greedy", "T=0.8", "T=0.8 top_k=5",
                                                                      "T=1.2 top_p=0.9"]  # fmt: skip
        assert "lossless: OK for the 1 greedy request; 4 sampled requests are exact in distribution" in proc.stdout
        files.append(out.read_bytes())
    assert files[0] == files[1]
