"""`epdraft check`: every fixture prints its plan and exits 0; a bad config exits 2 naming the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from epdraft import cli

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
REPO = Path(__file__).parent.parent


def run_check(capsys, path: Path) -> tuple[int, str, str]:
    code = cli.main(["check", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("fixture", sorted(p.name for p in FIXTURES.glob("*.json")))
def test_every_fixture_prints_its_plan(capsys, fixture):
    code, out, err = run_check(capsys, FIXTURES / fixture)
    assert code == 0, err
    header, *lines, total = out.strip().splitlines()
    quantized = lines[0].startswith("weights:")
    columns, *rows = lines[2:] if quantized else lines  # a quantized one: its format, what CUDA holds
    assert "family" in header and "layers" in header
    assert columns.split()[:2] == ["layers", "kind"]
    assert rows and all(row.split()[1] in ("dense", "MoE") for row in rows)
    assert total.startswith("routed expert weights (fp4):" if fixture == "deepseek-v4-flash.json" else
                            "routed expert weights (bf16):")


def test_deepseek_v3_plan(capsys):
    code, out, _ = run_check(capsys, FIXTURES / "deepseek-v3.json")
    rows = out.strip().splitlines()[2:-1]
    assert code == 0 and len(rows) == 2
    assert rows[0].split()[:3] == ["0-2", "dense", "18432"]
    assert rows[1].split()[:6] == ["3-60", "MoE", "256", "x", "2048", "8"]
    assert "sigmoid renorm noaux_tc groups 8/4 x2.5" in rows[1] and "2048 ungated" in rows[1]
    per_layer = 256 * 3 * 2048 * 7168 * 2
    assert f"({58 * per_layer} bytes)" in out


def test_plan_columns_per_family(capsys):
    _, out, _ = run_check(capsys, FIXTURES / "gpt-oss-20b.json")
    assert "softmax_topk logit-bias" in out and "swigluoai alpha 1.702 clamp 7 +bias" in out
    _, out, _ = run_check(capsys, FIXTURES / "qwen3.8-27b-dspark-moe-v2.json")
    assert "softmax renorm logit-bias" in out and "2048 gated" in out
    _, out, _ = run_check(capsys, FIXTURES / "deepseek-v4-flash-dspark-moe.json")
    assert "sqrtsoftplus renorm noaux_tc x1.5" in out and "swiglu clamp 10" in out


def test_draft_variants_in_the_plan(capsys, tmp_path):
    """Sliding layers, hash layers and the DSpark heads and readout show in the plan."""
    types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    config = _with("deepseek-v4-flash-dspark-moe", layer_types=types, sliding_window=2048, num_hash_layers=2)
    config["dflash_config"] |= {"markov_head_type": "rnn", "mask_filling": False, "confidence_head_with_markov": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, err = run_check(capsys, path)
    assert code == 0, err
    header, columns, *rows, _ = out.strip().splitlines()
    assert "dspark block 7, autoregressive readout (7 drafts), markov rnn r256, confidence head" in header
    assert "(+markov)" not in header and columns.split()[-1] == "attention"
    assert [r.split()[0] for r in rows] == ["0-1", "2", "3", "4"]
    assert "hash sqrtsoftplus renorm x1.5" in rows[0] and rows[0].endswith("sliding 2048")
    assert "hash" not in rows[1] and "noaux_tc" in rows[1] and rows[1].endswith("full")
    assert rows[2].endswith("sliding 2048") and rows[3].endswith("full")


def test_target_sliding_layers_in_the_plan(capsys, tmp_path):
    config = _with("qwen3-30b-a3b", layer_types=["full_attention", "sliding_attention"] * 24, sliding_window=128)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, _ = run_check(capsys, path)
    rows = out.strip().splitlines()[2:-1]
    assert code == 0 and len(rows) == 48
    assert rows[0].endswith("full") and rows[1].endswith("sliding 128") and rows[1].split()[0] == "1"


@pytest.mark.parametrize(
    "name, quantization, needles",
    [
        ("gpt-oss-20b", {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]},
         ("weights: mxfp4 (e2m1 values, e8m0 scale per 32), not converted: model.layers.*.self_attn, lm_head",
          "experts (mxfp4)", "routed expert weights (mxfp4)",
          "on CUDA with bf16: dequantized at load (gpt-oss interleaves gate and up rows")),
        ("deepseek-v3", {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
         ("weights: fp8 e4m3 (fp32 scale per 128x128 block)", "experts (fp8)",
          "on CUDA with bf16: routed experts stay fp8 for the fused kernels")),
        ("qwen3-30b-a3b", {"quant_method": "fp8", "weight_block_size": [128, 128],
                           "modules_to_not_convert": ["mlp.experts"]},
         ("not converted: mlp.experts", "experts (bf16)", "routed expert weights (bf16)")),
    ],
)
def test_quantized_config_shows_its_format_and_stored_bytes(capsys, tmp_path, name, quantization, needles):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_with(name, quantization_config=quantization)))
    code, out, err = run_check(capsys, path)
    assert code == 0, err
    for needle in needles:
        assert needle in out, out
    if name == "deepseek-v3":  # 58 MoE layers of 256 x 3 x 2048 x 7168 weights, 8 bits + 32 / (128 * 128)
        assert f"({round(58 * 256 * 3 * 2048 * 7168 * (8 + 32 / 128**2) / 8)} bytes)" in out


def test_directory_reads_its_config_json(capsys, tmp_path):
    (tmp_path / "config.json").write_text((FIXTURES / "mixtral-8x7b.json").read_text())
    code, out, _ = run_check(capsys, tmp_path)
    assert code == 0 and "0-31" in out and "8 x 14336" in out


def _with(name: str, **changes) -> dict:
    config = json.loads((FIXTURES / f"{name}.json").read_text())
    config.update(changes)
    return config


MALFORMED = [
    (_with("deepseek-v3", n_group=3), "n_group = 3 must divide n_routed_experts = 256"),
    (_with("deepseek-v3", topk_group=0), "topk_group = 0"),
    (_with("deepseek-v3", quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (_with("deepseek-v3", scoring_func="softmax"), "scoring_func = 'softmax'"),
    (_with("mixtral-8x7b", num_experts_per_tok=9), "num_experts_per_tok = 9"),
    (_with("mixtral-8x7b", hidden_act="gelu"), "hidden_act = 'gelu'"),
    (_with("qwen2-57b-a14b", shared_expert_intermediate_size=0), "shared_expert_intermediate_size = 0"),
    (_with("qwen3-30b-a3b", moe_intermediate_size=-4), "moe_intermediate_size = -4"),
    (_with("deepseek-v4-flash", num_hash_layers=44), "num_hash_layers = 44"),
    (_with("deepseek-v4-flash", num_hash_layers=2, first_k_dense_replace=1), "layers [0] are dense"),
    (_with("deepseek-v4-flash", mlp_layer_types=["hash"] + ["moe"] * 42), "mlp_layer_types[0] = 'hash'"),
    (_with("qwen3.8-27b-dspark-moe", layer_types=["sliding_attention"] * 5, sliding_window=0), "sliding_window = 0"),
    (_with("qwen3.8-27b-dspark-moe", layer_types=["sliding_attention"] * 5), "sliding_window is missing"),
    (_with("qwen3.8-27b-dspark-moe", layer_types=["full_attention", "local"] + ["full_attention"] * 3), "layer_types[1] = 'local'"),
    (_with("qwen3.8-27b-dspark-moe", markov_head_type="lstm"), "markov_head_type = 'lstm'"),
    (_with("qwen3.8-27b-dspark-moe", dspark_block_size=9), "dspark_block_size = 9 contradicts block_size = 7"),
    (_with("qwen3-30b-a3b", layer_types=["sliding_attention"] * 48, sliding_window=-1), "sliding_window = -1"),
    (_with("gpt-oss-20b", quantization_config={"quant_method": "mxfp6"}), "quant_method = 'mxfp6'"),
    (_with("deepseek-v3", quantization_config={"quant_method": "fp8", "weight_block_size": [128]}),
     "quantization_config.weight_block_size = [128]"),
    (_with("qwen3.8-27b-dspark-moe", n_shared_experts=2), "n_shared_experts = 2"),
    (_with("qwen3.8-27b-dspark-moe", scoring_func="tanh"), "scoring_func = 'tanh'"),
    (_with("qwen3.8-27b-dspark-moe", moe_preset="nope"), "moe_preset = 'nope'"),
    (_with("qwen3.8-27b-dspark-moe", num_hidden_layers=None), "num_hidden_layers is missing"),
]


@pytest.mark.parametrize("config, needle", MALFORMED, ids=[m[1] for m in MALFORMED])
def test_malformed_config_exits_2_naming_the_key(capsys, tmp_path, config, needle):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, err = run_check(capsys, path)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err and str(path) in err, err


def test_unreadable_inputs_exit_2_naming_the_file(capsys, tmp_path):
    code, _, err = run_check(capsys, tmp_path / "missing.json")
    assert code == 2 and "missing.json: cannot read" in err
    code, _, err = run_check(capsys, tmp_path)  # a directory without config.json
    assert code == 2 and "config.json: cannot read" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = run_check(capsys, bad)
    assert code == 2 and "bad.json: invalid JSON" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("arg", ["configs/local-cpu-2.toml", "deploy.yaml", "DEPLOY.YML"])
def test_a_parallel_config_file_is_pointed_to_plan(capsys, arg):
    code, out, err = run_check(capsys, arg)
    assert code == 2 and not out
    assert err == (f"epdraft check: {arg}: a parallel config, not a model's config.json; "
                   f"check it against a draft with `epdraft plan {arg} DRAFT_DIR`\n")  # fmt: skip


@pytest.mark.parametrize("sections", [("cluster", "draft", "target"), ("cluster",), ("draft", "target", "placement")])
def test_a_parallel_config_json_is_pointed_to_plan(capsys, tmp_path, sections):
    full = {"cluster": {"nnodes": 1, "nproc_per_node": 2}, "draft": {"attn_dp": 2}, "target": {"dp": 2},
            "placement": {"mode": "colocated"}}  # fmt: skip
    path = tmp_path / "deploy.json"
    path.write_text(json.dumps({k: full[k] for k in sections}))
    code, out, err = run_check(capsys, path)
    assert code == 2 and not out
    assert err == (f"epdraft check: {path}: a parallel config, not a model's config.json; "
                   f"check it against a draft with `epdraft plan {path} DRAFT_DIR`\n")  # fmt: skip


def test_a_shipped_config_name_is_pointed_to_plan_naming_its_file(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_check(capsys, "local-cpu-4")
    shipped = REPO / "epdraft" / "configs" / "local-cpu-4.toml"
    assert code == 2 and not out
    assert err == (f"epdraft check: {shipped}: a parallel config, not a model's config.json; "
                   "check it against a draft with `epdraft plan local-cpu-4 DRAFT_DIR`\n")  # fmt: skip
    (tmp_path / "local-cpu-4").mkdir()  # a directory of that name here is a draft directory, read as one
    code, _, err = run_check(capsys, "local-cpu-4")
    assert code == 2 and err.startswith(f"epdraft check: {Path('local-cpu-4') / 'config.json'}: cannot read")


@pytest.mark.timeout(120)
def test_module_entry_point_subprocess():
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    fixture = FIXTURES / "qwen3-30b-a3b.json"
    done = subprocess.run([sys.executable, "-m", "epdraft.cli", "check", str(fixture)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=100)
    assert done.returncode == 0, done.stderr
    assert "family qwen3_moe" in done.stdout and "0-47" in done.stdout and "128 x 768" in done.stdout


def test_deepseek_dspark_draft_shows_its_attention_window_and_mhc(capsys, tmp_path):
    """SpecForge's DeepSeek-V4 DSpark export config: the attention kind, window, heads and mHC per layer."""
    config = Path(__file__).resolve().parent / "fixtures" / "deepseek_v4_flash_dspark_config.json"
    (tmp_path / "config.json").write_bytes(config.read_bytes())
    assert cli.main(["check", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "dspark_v4 block 5" in out and "markov vanilla r256" in out
    assert "deepseek v4: 64 q heads over 1 K=V head 512 (rope 64, sinks), window 128, o 8x1024; mHC x4" in out


def test_deepseek_v4_flash_released_config_shows_fp4_experts_fp8_linears_and_hash_layers(capsys):
    code, out, err = run_check(capsys, FIXTURES / "deepseek-v4-flash.json")
    assert code == 0, err
    for needle in ("43 layers (0 dense, 43 MoE, 3 hash-routed)",
                   "weights: linears fp8 e4m3 (e8m0 scale per 128x128 block); routed experts fp4",
                   "experts (fp4)", "routed experts stay fp4"):
        assert needle in out, out
    rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    assert [r[0] for r in rows] == ["0-2", "3-42"] and rows[0][6] == "hash" and rows[1][6] != "hash"
    # 40 + 3 layers of 256 x 3 x 2048 x 4096 weights at 4 bits + one 8-bit scale per 32
    assert f"({round(43 * 256 * 3 * 2048 * 4096 * 4.25 / 8)} bytes)" in out


def test_deepseek_v41_dspark_draft_config_shows_its_32x32_fp8_blocks(capsys, tmp_path):
    config = json.loads((Path(__file__).parent / "fixtures" / "deepseek_v4_flash_dspark_config.json").read_text())
    config["dflash_config"].update(attention_mode="deepseek_v41", context_window=config.pop("sliding_window"))
    config |= {"expert_dtype": "fp4", "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
        "weight_block_size": [32, 32]}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, err = run_check(capsys, path)
    assert code == 0, err
    assert "linears fp8 e4m3 (e8m0 scale per 32x32 block); routed experts fp4" in out, out
    assert "deepseek v41" in out and "experts (fp4)" in out
