"""`epdraft run`'s preflight: every bad input is one line naming the culprit, exit 2, and no rank starts.

Most cases call `cli.main` in-process with the launcher replaced by a tripwire, so each costs a
fraction of a second; two end-to-end cases check the real command starts no torchrun.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from epdraft import cli
from epdraft import run as run_module
from epdraft.preflight import check_run

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "epdraft" / "assets"
PROMPTS = [json.loads(line)["input_ids"] for line in (ASSETS / "prompts.jsonl").read_text().splitlines()]


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if the command gets as far as starting torchrun."""

    def tripwire(*args, **kwargs):
        raise AssertionError("torchrun was started")

    monkeypatch.setattr(run_module, "run_torchrun", tripwire)
    monkeypatch.setattr(run_module, "run_local_nodes", tripwire)


def refused(capsys, argv: list[str]) -> str:
    """Run `epdraft ARGV`; assert exit 2 and exactly one line on stderr, nothing on stdout; return the line."""
    code = cli.main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and not out, err + out
    assert "Traceback" not in err
    return lines[0]


def _copy(name: str, tmp_path: Path) -> Path:
    dest = tmp_path / name
    shutil.copytree(ASSETS / name, dest)
    return dest


def _edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def _edit_tensors(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])


def _prompts(tmp_path: Path, lines: list) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _config(tmp_path: Path, text: str | bytes, name: str = "cfg.toml") -> Path:
    path = tmp_path / name
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


def _draft(tmp_path, **changes):
    d = _copy("tiny-draft", tmp_path)
    _edit_config(d, **changes)
    return ["--draft", str(d)]


def _draft_tensors(tmp_path, edit):
    d = _copy("tiny-draft", tmp_path)
    _edit_tensors(d, edit)
    return ["--draft", str(d)]


def _target(tmp_path, **changes):
    t = _copy("tiny-target", tmp_path)
    _edit_config(t, **changes)
    return ["--target", str(t)]


def _nan(tensors):
    tensors["layers.1.mlp.experts.5.up_proj.weight"][3, 7] = math.nan


def _ints(tensors):
    tensors["fc.weight"] = tensors["fc.weight"].to(torch.int32)


def _wrong_shape(tensors):
    tensors["fc.weight"] = tensors["fc.weight"][:, :200].contiguous()


def _truncated_draft(tmp_path):
    d = _copy("tiny-draft", tmp_path)
    _truncate(d / "model.safetensors")
    return ["--draft", str(d)]


def _truncated_target(tmp_path):
    t = _copy("tiny-target", tmp_path)
    _truncate(t / "model.safetensors")
    return ["--target", str(t)]


def _no_config(tmp_path, name):
    d = _copy(name, tmp_path)
    (d / "config.json").unlink()
    return [f"--{name.split('-')[1]}", str(d)]


def _file_as(tmp_path, flag):
    f = tmp_path / "file"
    f.write_text("x")
    return [flag, str(f)]


def _draft_as_target(tmp_path):
    return ["--target", str(ASSETS / "tiny-draft")]


def _draft_copy_as_target(tmp_path):
    return ["--target", str(_copy("tiny-draft", tmp_path))]


def _json_into_missing_folder(tmp_path):
    return ["--json", str(tmp_path / "missing" / "out.json")]


def _json_is_dir(tmp_path):
    return ["--json", str(tmp_path)]


def _three_ranks_ep3(tmp_path):
    return ["--set", "cluster.nproc_per_node=3", "--set", "draft.attn_dp=3", "--set", "target.dp=3",
            "--set", "draft.moe_ep=3"]  # fmt: skip


def _text_without_tokenizer(tmp_path):
    """The shipped target without its tokenizer files."""
    target = _copy("tiny-target", tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target / name).unlink()
    return ["--target", str(target), "--prompts", str(_prompts(tmp_path, [{"text": "hello"}]))]


def _long_prompt(tmp_path):
    return ["--prompts", str(_prompts(tmp_path, [{"input_ids": PROMPTS[0]}, {"input_ids": [5] * 1000}]))]


def _prompts_case(*lines):
    return lambda tmp_path: ["--prompts", str(_prompts(tmp_path, list(lines)))]


def _non_utf8_prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"input_ids": [1, 2]}\n{"text": "caf\xe9"}\n')
    return ["--prompts", str(path)]


def _config_case(text: str | bytes, name: str = "cfg.toml"):
    return lambda tmp_path: [str(_config(tmp_path, text, name))]


LOCAL_CPU_2 = (REPO / "configs" / "local-cpu-2.toml").read_text()

# (id, argv after `run` built in tmp_path, text the one line must contain)
RUN_CASES = [
    ("max-new-tokens-0", lambda p: ["--max-new-tokens", "0"], "--max-new-tokens 0: expected an integer >= 1"),
    ("max-new-tokens-negative", lambda p: ["--max-new-tokens", "-4"], "--max-new-tokens -4: expected an integer >= 1"),
    ("max-prompts-negative", lambda p: ["--max-prompts", "-1"], "--max-prompts -1: expected an integer >= 0"),
    ("show-negative", lambda p: ["--show", "-2"], "--show -2: expected an integer >= 0"),
    ("hang-timeout-over-timeout", lambda p: ["--set", "cluster.hang_timeout_s=90"],
     "cluster.hang_timeout_s = 90: expected seconds in [2, cluster.timeout_s = 60)"),
    ("json-missing-folder", _json_into_missing_folder, "/missing does not exist"),
    ("output-missing-folder", lambda p: ["--output", str(p / "missing" / "out.jsonl")],
     "--output " ),
    ("output-is-a-directory", lambda p: ["--output", str(p)], "is a directory, expected a file path"),
    ("temperature-negative", lambda p: ["--temperature", "-0.5"],
     "--temperature -0.5: expected a finite number >= 0 (0 = greedy)"),
    ("temperature-nan", lambda p: ["--temperature", "nan"], "--temperature nan: expected a finite number >= 0"),
    ("top-k-0", lambda p: ["--top-k", "0"], "--top-k 0: expected an integer >= 1 (leave it out to keep every token)"),
    ("top-p-over-1", lambda p: ["--top-p", "1.5"], "--top-p 1.5: expected a number in (0, 1] (1 = keep every token)"),
    ("top-p-0", lambda p: ["--top-p", "0"], "--top-p 0.0: expected a number in (0, 1]"),
    ("seed-negative", lambda p: ["--seed", "-1"], "--seed -1: expected an integer in [0, 2**63)"),
    ("seed-too-big", lambda p: ["--seed", str(2**63)], f"--seed {2**63}: expected an integer in [0, 2**63)"),
    ("disagg-temperature-flag", lambda p: ["configs/local-cpu-disagg.toml", "--temperature", "0.8"],
     "--temperature 0.8 needs placement.mode = 'colocated' (a disaggregated draft's proposal probabilities do not "
     "cross the link yet)"),
    ("disagg-sampled-line", lambda p: ["configs/local-cpu-disagg.toml", "--prompts",
                                       str(_prompts(p, [{"input_ids": PROMPTS[0]},
                                                        {"input_ids": PROMPTS[1], "temperature": 0.8}]))],
     "prompts.jsonl:2: temperature 0.8 needs placement.mode = 'colocated'"),
    ("json-is-a-directory", _json_is_dir, "is a directory, expected a file path"),
    ("log-level", lambda p: [], None),  # built specially below
    ("draft-missing", lambda p: ["--draft", str(p / "nope")], "--draft " ),
    ("draft-is-a-file", lambda p: _file_as(p, "--draft"), "not a directory, expected a model directory"),
    ("draft-without-config", lambda p: _no_config(p, "tiny-draft"), "config.json: cannot read"),
    ("draft-bad-top-k", lambda p: _draft(p, num_experts_per_tok=9), "config.json: num_experts_per_tok = 9"),
    ("draft-bad-block-size", lambda p: _draft(p, block_size=1, dflash_config={"block_size": 1, "mask_token_id": 259,
                                                                             "target_layer_ids": [1, 2]}),
     "block_size"),
    ("draft-missing-expert", lambda p: _draft_tensors(p, lambda t: t.pop("layers.1.mlp.experts.3.down_proj.weight")),
     "partial export, 1 missing: layer 1: 1 tensor(s) missing: layers.1.mlp.experts.3.down_proj.weight"),
    ("draft-wrong-shape", lambda p: _draft_tensors(p, _wrong_shape), "fc.weight: expected shape [128, 256], found [128, 200]"),
    ("draft-int-dtype", lambda p: _draft_tensors(p, _ints), "fc.weight: dtype I32, expected one of F64, F32, F16, BF16, F8_E4M3, F8_E5M2, F8_E8M0, U8, I8"),
    ("draft-nan-weights", lambda p: _draft_tensors(p, _nan),
     "layers.1.mlp.experts.5.up_proj.weight: 1 of 12288 values are NaN or inf"),
    ("draft-truncated", _truncated_draft, "model.safetensors: truncated:"),
    ("draft-mask-outside-vocab", lambda p: _draft(p, dflash_config={"block_size": 8, "mask_token_id": 300,
                                                                     "target_layer_ids": [1, 2]}),
     "mask_token_id (300) outside the target vocabulary (260)"),
    ("target-hub-id", lambda p: ["--target", "Qwen/Qwen3-0.6B"],
     "--target Qwen/Qwen3-0.6B: no such directory (a local model directory is expected, never a hub id)"),
    ("target-is-the-draft", _draft_as_target, "is the --draft directory, expected the target model's HF directory"),
    ("target-is-a-draft", _draft_copy_as_target, "has dflash_config: a draft export, expected the target model"),
    ("target-without-config", lambda p: _no_config(p, "tiny-target"), "config.json: cannot read"),
    ("target-vocab-mismatch", lambda p: _target(p, vocab_size=300),
     "model.embed_tokens.weight has shape [260, 128], but"),
    ("target-truncated", _truncated_target, "model.safetensors: truncated:"),
    ("target-too-few-layers", lambda p: _target(p, num_hidden_layers=2),
     "dflash_config.target_layer_ids [2] outside the target's 2 layers"),
    ("target-vocab-not-int", lambda p: _target(p, vocab_size="260"), "vocab_size = '260', expected a positive integer"),
    ("layout-ep3-over-8-experts", _three_ranks_ep3, "draft.moe_ep = 3 must divide the draft's 8 experts"),
    ("prompts-missing", lambda p: ["--prompts", str(p / "none.jsonl")], "none.jsonl: cannot read"),
    ("prompts-non-utf8", _non_utf8_prompts, "prompts.jsonl:2: not UTF-8 (byte 0xe9)"),
    ("prompts-not-json", _prompts_case({"input_ids": [1]}, "{oops"), "prompts.jsonl:2: not JSON"),
    ("prompts-bool-id", _prompts_case({"input_ids": [1, True, 3]}), "prompts.jsonl:1: input_ids[1] = true is not a token id"),
    ("prompts-float-id", _prompts_case({"input_ids": [1.0]}), "prompts.jsonl:1: input_ids[0] = 1.0 is not a token id"),
    ("prompts-string-ids", _prompts_case({"input_ids": "1 2"}), "input_ids must be a list of token ids, got str"),
    ("prompts-no-key", _prompts_case({"ids": [1]}), "prompts.jsonl:1: expected a JSON object with 'input_ids'"),
    ("prompts-negative-temperature", _prompts_case({"input_ids": [1]}, {"input_ids": [2], "temperature": -1}),
     "prompts.jsonl:2: temperature = -1: expected `float` >= 0.0"),
    ("prompts-top-p-over-1", _prompts_case({"input_ids": [1], "top_p": 1.5}), "prompts.jsonl:1: top_p = 1.5"),
    ("prompts-bool-temperature", _prompts_case({"input_ids": [1], "temperature": True}),
     "prompts.jsonl:1: temperature = True: expected `float`, got `bool`"),
    ("prompts-float-seed", _prompts_case({"input_ids": [1], "seed": 1.5}), "prompts.jsonl:1: seed = 1.5"),
    ("prompts-empty-file", _prompts_case(), "no prompts, expected one JSON object per line"),
    ("prompts-blank-lines", _prompts_case("", "  "), "no prompts, expected one JSON object per line"),
    ("prompts-all-refused", _prompts_case({"input_ids": []}, {"input_ids": [1, 99999]}),
     "all 2 prompts would be refused (" ),
    ("prompts-text-without-tokenizer", _text_without_tokenizer, "prompts.jsonl:1: has 'text' but no tokenizer"),
    ("prompts-past-max-positions", _long_prompt,
     "prompts.jsonl:2: 1000 prompt tokens + --max-new-tokens 64 = 1064 positions, over the target's "
     "max_position_embeddings = 1024"),
    ("config-missing", lambda p: [str(p / "none.toml")], "none.toml: cannot read the parallel config"),
    ("config-non-utf8", _config_case(b"[cluster]\nnnodes = 1 # \xff\n"), "cfg.toml: not UTF-8 text (byte 23 is 0xff)"),
    ("config-timeout-inf", lambda p: ["--set", "cluster.timeout_s=inf"],
     "cluster.timeout_s = inf: expected seconds in [1, 86400]"),
    ("config-timeout-tiny", lambda p: ["--set", "cluster.timeout_s=0.001"],
     "cluster.timeout_s = 0.001: expected seconds in [1, 86400]"),
    ("target-tp-in-file", _config_case(LOCAL_CPU_2.replace("tp = 1\ndp = 2", "tp = 2\ndp = 1")),
     "cfg.toml: target.tp = 2: the standalone runner loads the whole HF target on every target rank (a "
     "tensor-parallel target is not implemented); set target.tp = 1 and target.dp = 2"),
    ("target-tp-override", lambda p: ["configs/local-cpu-4.toml", "--set", "target.tp=4", "--set", "target.dp=1"],
     "configs/local-cpu-4.toml: target.tp = 4: the standalone runner loads the whole HF target"),
]


@pytest.mark.parametrize("case,build,text", RUN_CASES, ids=[c[0] for c in RUN_CASES])
def test_bad_run_input_is_one_line_before_any_rank(capsys, tmp_path, no_ranks, case, build, text):
    if case == "log-level":
        line = refused(capsys, ["--log-level", "bogus", "run"])
        assert line == "epdraft run: --log-level bogus: expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL"
        return
    extra = build(tmp_path)
    config = [extra.pop(0)] if extra and not extra[0].startswith("--") else []
    line = refused(capsys, ["run", *config, *extra])
    assert line.startswith("epdraft run: ") and text in line, line
    if case == "draft-missing":
        assert line.endswith("no such directory (a local model directory is expected, never a hub id)")
    if case == "output-missing-folder":
        assert line.endswith("/missing does not exist")


def test_a_sampled_run_passes_colocated_and_a_greedy_one_disaggregated(tmp_path):
    from epdraft.config.parallel import load_parallel_config

    lines = [{"input_ids": PROMPTS[0], "temperature": 0.8, "top_k": 5, "seed": 3}, {"input_ids": PROMPTS[1]}]
    parser = cli.build_parser("run")
    args = parser.parse_args(["run", "--prompts", str(_prompts(tmp_path, lines)), "--temperature", "0.5",
                              "--output", str(tmp_path / "out.jsonl")])  # fmt: skip
    check_run(args, load_parallel_config(args.config))
    args = parser.parse_args(["run", "configs/local-cpu-disagg.toml", "--temperature", "0"])
    check_run(args, load_parallel_config(args.config))


def test_the_shipped_pair_passes_and_a_few_refused_prompts_only_warn(tmp_path, caplog):
    args = cli.build_parser("run").parse_args(
        ["run", "--prompts", str(_prompts(tmp_path, [{"input_ids": PROMPTS[0]}, {"input_ids": []}]))]
    )
    from epdraft.config.parallel import load_parallel_config

    check_run(args, load_parallel_config(args.config))
    assert "1 of 2 prompts will be refused, the others run: " in caplog.text
    assert "prompts.jsonl:2: request 1: empty prompt" in caplog.text


def _three_rank_config(tmp_path: Path) -> Path:
    return _config(
        tmp_path,
        LOCAL_CPU_2.replace("nproc_per_node = 2", "nproc_per_node = 3")
        .replace("attn_dp = 2", "attn_dp = 3")
        .replace("moe_ep = 2", "moe_ep = 3")
        .replace("dp = 2", "dp = 3"),
    )


def test_plan_refuses_what_run_refuses_with_the_same_message(capsys, tmp_path, no_ranks):
    config = _three_rank_config(tmp_path)
    draft = ASSETS / "tiny-draft"
    plan = refused(capsys, ["plan", str(config), str(draft)])
    run = refused(capsys, ["run", str(config)])
    assert plan.removeprefix("epdraft plan: ") == run.removeprefix("epdraft run: "), (plan, run)
    assert "draft.moe_ep = 3 must divide the draft's 8 experts" in plan


@pytest.mark.parametrize(
    "flags,text",
    [
        (["--rows", "-1"], "--rows -1: expected an integer >= 0"),
        (["--bandwidth-gbps", "-2"], "--bandwidth-gbps -2: expected a finite number > 0"),
        (["--latency-us", "-1"], "--latency-us -1: expected a finite number >= 0"),
        (["--memory-gib", "0"], "--memory-gib 0: expected a finite number > 0"),
        (["--dtype-bytes", "0"], "--dtype-bytes 0: expected an integer >= 1"),
    ],
)
def test_plan_refuses_negative_numbers(capsys, flags, text):
    line = refused(capsys, ["plan", "configs/local-cpu-2.toml", str(ASSETS / "tiny-draft"), *flags])
    assert line == f"epdraft plan: {text}"


@pytest.mark.parametrize(
    "flags,text",
    [
        (["--top-k", "9"], "--top-k 9: expected 1 <= top-k <= --experts 8"),
        (["--top-k", "0"], "--top-k 0: expected 1 <= top-k <= --experts 8"),
        (["--experts", "0"], "--experts 0: expected integers >= 1"),
        (["--experts", "7"], "--experts 7: draft.moe_ep = 2 must divide it"),
        (["--hidden", "0"], "--hidden 0: expected integers >= 1"),
    ],
)
def test_bench_dispatch_refuses_impossible_shapes(capsys, flags, text):
    line = refused(capsys, ["bench", "dispatch", "--config", "configs/local-cpu-2.toml", "--rows", "4", *flags])
    assert line == f"epdraft bench: {text}"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


@pytest.mark.timeout(60)
def test_end_to_end_a_bad_flag_starts_no_rank():
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "epdraft.cli", "run", "--max-new-tokens", "0"], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=50)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr == "epdraft run: --max-new-tokens 0: expected an integer >= 1\n" and not done.stdout
    assert time.monotonic() - start < 10


@pytest.mark.timeout(60)
def test_end_to_end_a_taken_master_port_starts_no_rank():
    """Two local nodes (disaggregated): node 0 would host the rendezvous on a port that is taken."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "epdraft.cli", "run", "configs/local-cpu-disagg.toml", "--master-port", str(port)],
            env=_env(), cwd=REPO, capture_output=True, text=True, timeout=50,
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"epdraft run: --master-port {port}: in use on this host"), done.stderr
    assert "torch.distributed.run" not in done.stdout + done.stderr


def test_header_reader_refuses_a_foreign_file(tmp_path):
    from epdraft.errors import LoadError
    from epdraft.loading.header import read_header

    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 5) + b"[1,2]")
    with pytest.raises(LoadError, match=r"x.safetensors: not a safetensors file \(header is not a JSON object\)"):
        read_header(path)
    path.write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(LoadError, match=r"truncated or not a safetensors file"):
        read_header(path)


@pytest.mark.parametrize("dspark,moe,prefix", [(True, True, ""), (False, False, "model."), (True, False, "")])
def test_meta_load_accepts_every_export_the_ranks_load(tmp_path, dspark, moe, prefix):
    from epdraft.errors import LoadError
    from epdraft.models import DFlashDraft, DSparkDraft
    from epdraft.models.spec import DraftModelSpec
    from epdraft.preflight import check_draft
    from tests.models.helpers import draft_config, randomize, write_export

    cfg = draft_config(moe=moe, dspark=dspark)
    spec = DraftModelSpec.from_config(cfg)
    draft = (DSparkDraft if dspark else DFlashDraft)(spec)
    randomize(draft)
    assert check_draft(write_export(draft, cfg, tmp_path / "ok", prefix=prefix))[0] == spec
    dropped = "layers.1.mlp.down_proj.weight" if not moe else "layers.1.mlp.experts.7.up_proj.weight"
    with pytest.raises(LoadError, match=f"missing: .*{dropped}"):
        check_draft(write_export(draft, cfg, tmp_path / "partial", prefix=prefix, drop=(dropped,)))


def test_no_check_weights_skips_the_value_check_only(tmp_path):
    from epdraft.config.parallel import load_parallel_config

    nan_draft = _draft_tensors(tmp_path, _nan)
    args = cli.build_parser("run").parse_args(["run", *nan_draft, "--no-check-weights"])
    check_run(args, load_parallel_config(args.config))  # headers and shapes are fine


OTHER_CASES = [
    (["check", "no/such/draft"], "epdraft check: no/such/draft: cannot read"),
    (["check", "{bad}"], "epdraft check: {bad}: invalid JSON"),
    (["launch", "configs/local-cpu-4.toml", "--node-rank", "1"],
     "epdraft launch: --node-rank 1 is not a node index in [0, cluster.nnodes = 1)"),
    (["launch", "configs/local-cpu-4.toml", "--set", "cluster.nnodes=2", "--set", "cluster.nproc_per_node=2",
      "--master-port", "70000"], "epdraft launch: --master-port 70000 is not a TCP port in [1, 65535]"),
    (["launch", "configs/local-cpu-4.toml", "--set", "cluster.timeout_s=inf"], "cluster.timeout_s = inf: expected"),
    (["launch", "configs/local-cpu-4.toml", "--set", "draft.moe_ep"], "--set 'draft.moe_ep': expected section.key=value"),
    (["run", "configs/local-cpu-disagg.toml", "--node-rank", "2"],
     "epdraft run: --node-rank 2 is not a node index in [0, cluster.nnodes = 2)"),
    (["plan", "configs/local-cpu-2.toml", "no/such/draft"], "epdraft plan: no/such/draft: cannot read"),
    (["plan", "configs/nope.toml", str(ASSETS / "tiny-draft")], "epdraft plan: configs/nope.toml: cannot read"),
    (["bench", "dispatch", "--config", "configs/local-cpu-2.toml", "--rows", "-1"], "epdraft bench: --rows -1 must be >= 0"),
]


@pytest.mark.parametrize("argv,text", OTHER_CASES, ids=[" ".join(c[0][:2]) + f"-{i}" for i, c in enumerate(OTHER_CASES)])
def test_bad_input_to_the_other_commands_is_one_line(capsys, tmp_path, monkeypatch, argv, text):
    from epdraft import launch

    monkeypatch.setattr(launch, "run_torchrun", lambda *a, **k: pytest.fail("torchrun was started"))
    monkeypatch.setattr(run_module, "run_local_nodes", lambda *a, **k: pytest.fail("torchrun was started"))
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff{")
    line = refused(capsys, [str(bad) if a == "{bad}" else a for a in argv])
    assert text.replace("{bad}", str(bad)) in line, line


def test_mooncake_without_its_system_library_is_refused_before_any_rank(capsys, tmp_path, no_ranks, monkeypatch):
    """Mooncake's wheel installed but libibverbs.so.1 missing fails only at import: preflight imports
    it (in well under 3 s) and names the library and the package that provides it."""
    import time

    from epdraft.worker.transfer import mooncake

    missing = ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")

    def import_fails():
        return mooncake.import_failure_reason(missing)

    monkeypatch.setattr(mooncake, "unavailable_reason", import_fails)
    started = time.monotonic()
    line = refused(capsys, ["run", "configs/local-cpu-disagg.toml", "--set", "placement.transfer=mooncake"])
    assert time.monotonic() - started < 3
    assert line == ("epdraft run: placement.transfer = 'mooncake' needs the system library libibverbs.so.1, which "
                    "Mooncake's wheel links (Debian: apt-get install -y libibverbs1) (libibverbs.so.1: cannot open "
                    "shared object file: No such file or directory)")


def test_run_without_transformers_names_the_extra(capsys, no_ranks, monkeypatch):
    """The standalone runner's target needs transformers (extra `[hf]`): refused first, in one line."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else find_spec(name, *a))
    line = refused(capsys, ["run"])
    assert line == ("epdraft run: the standalone runner's target runs on transformers, which is not installed: "
                    "pip install 'epdraft[hf]'")
