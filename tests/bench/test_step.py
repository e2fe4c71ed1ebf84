"""`epdraft bench step --plot` and `--from-json`: the plot drawn from saved results, without a GPU.

The rows are those `epdraft bench step --json` writes (docs/performance.md's run: two contexts,
an `--attention` table, then the same points appended by a second run), so the plot must skip the
attention rows and keep one point per (preset, context, N). Drawing needs matplotlib (the `plot`
extra, which CI does not install): those tests skip without it, the input checks run everywhere.
"""

from __future__ import annotations

import json

import pytest

from epdraft.cli import main

STEP = [(1, 1024, 2.31, 0.55), (8, 1024, 2.93, 0.59), (64, 1024, 5.89, 1.95), (1, 8192, 2.45, 0.59),
        (8, 8192, 3.16, 0.87), (64, 8192, 7.91, 3.06)]  # fmt: skip


def _rows(preset: str = "issue13", kind: bool = True) -> list[dict]:
    rows = []
    for n, context, graph, floor in STEP:
        row = dict(preset=preset, requests=n, context=context, cache_ms=None, eager_ms=11.0, graph_ms=graph,
                   floor_ms=floor, bytes=1, flops=1.0, kernels=657, graph_equals_eager=True,
                   device="NVIDIA H200", torch="2.11.0+cu130")  # fmt: skip
        rows.append(dict(kind="step", **row) if kind else row)
    rows.append(dict(kind="attention", requests=1, context=1024, triton_us=237.5, sdpa_us=95.4, flex_us=None,
                     flex_max_abs_diff=None, flex_error="no triton", sdpa_gather_us=208.0, floor_us=1.0,
                     kv_bytes=4))  # fmt: skip
    return rows


def _write(path, rows: list[dict], extra: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + extra)


def _bench(*options: str) -> int:
    return main(["bench", "step", *options])


def test_plot_from_json_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    results, out = tmp_path / "bench-step.jsonl", tmp_path / "step.png"
    # A file from before step rows carried `kind`, a second run appended, a blank line, another preset.
    _write(results, _rows(kind=False) + _rows() + _rows(preset="v4like"), extra="\n")
    assert _bench("--from-json", str(results), "--plot", str(out)) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {out}" in capsys.readouterr().out


def test_plot_from_json_with_only_attention_rows_is_refused(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    results, out = tmp_path / "attention.jsonl", tmp_path / "step.png"
    _write(results, [r for r in _rows() if r["kind"] == "attention"])
    assert _bench("--from-json", str(results), "--plot", str(out)) == 2
    assert "no step results to draw (other rows are not plotted)" in capsys.readouterr().err
    assert not out.exists()


def test_from_json_needs_plot(tmp_path, capsys):
    results = tmp_path / "bench-step.jsonl"
    _write(results, _rows())
    assert _bench("--from-json", str(results)) == 2
    assert "draws a plot from saved results: add --plot OUT.png" in capsys.readouterr().err


def test_from_json_names_the_bad_line(tmp_path, capsys):
    results = tmp_path / "bench-step.jsonl"
    _write(results, _rows()[:2], extra="{not json\n")
    assert _bench("--from-json", str(results), "--plot", str(tmp_path / "step.png")) == 2
    assert f"{results}:3: not a JSON line of `epdraft bench step --json`" in capsys.readouterr().err


def test_plot_without_matplotlib_names_the_extra_before_running(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import matplotlib -> ImportError
    results = tmp_path / "bench-step.jsonl"
    _write(results, _rows())
    assert _bench("--from-json", str(results), "--plot", str(tmp_path / "step.png")) == 2
    assert "--plot needs matplotlib: pip install 'epdraft[plot]'" in capsys.readouterr().err


def test_plot_into_a_missing_directory_is_refused(tmp_path, capsys):
    out = tmp_path / "no-such-dir" / "step.png"
    assert _bench("--plot", str(out)) == 2
    assert f"--plot {out}: directory {out.parent} does not exist" in capsys.readouterr().err


def test_kernel_breakdown_counts_sums_and_ranks_by_time():
    from epdraft.bench.step import kernel_breakdown

    kernels = [("gemm", 10.0), ("norm", 1.0), ("gemm", 12.0), ("rope", 3.0), ("norm", 1.5)]
    count, busy, top = kernel_breakdown(kernels, top=2)
    assert (count, busy) == (5, 27.5)
    assert top == [("gemm", 2, 22.0), ("rope", 1, 3.0)]


def test_weights_flag_is_checked_before_any_gpu_work(capsys):
    assert _bench("--weights", "bf16,fp8") == 2
    assert "--weights 'bf16,fp8': expected a comma list of bf16, quantized (each once)" in capsys.readouterr().err
    assert _bench("--preset", "issue13", "--weights", "bf16,quantized") == 2
    err = capsys.readouterr().err
    assert "--weights quantized builds DeepSeek's released layout" in err and "this one is 'dflash'" in err


def test_a_quantized_run_is_its_own_plot_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows = [dict(r, weights=w) for w in ("bf16", "quantized") for r in _rows("v41-flash") if r["kind"] == "step"]
    results, out = tmp_path / "bench-step.jsonl", tmp_path / "step.png"
    _write(results, rows)
    assert _bench("--from-json", str(results), "--plot", str(out)) == 0
    assert out.stat().st_size > 0
