"""`epdraft bench sync`: a table of W vs ms and the ratio to W = 2 on stdout, JSON lines in `--json`."""

from __future__ import annotations

import json

import pytest

from epdraft.cli import main as cli_main
from epdraft.parallel.exchange import shared_memory_ok

METHODS = (["host"] if shared_memory_ok() else []) + ["store", "gloo_allgather"]


@pytest.mark.timeout(120)
def test_table_and_json_lines_for_each_method_and_size(capsys, tmp_path):
    out = tmp_path / "sync.jsonl"
    argv = ["bench", "sync", "--ranks", "2", "3", "--iters", "3", "--warmup", "1", "--json", str(out)]
    assert cli_main(argv) == 0
    stdout = capsys.readouterr().out.splitlines()
    assert stdout[0].split() == ["method", "ranks", "median", "ms", "x", "W=2"], stdout
    table = [[m, w] for m in METHODS for w in ("2", "3")]
    assert [line.split()[:2] for line in stdout[1 : 1 + len(table)]] == table, stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["bench"], r["method"], r["ranks"], r["iters"]) for r in rows] == [
        ("sync", m, w, 3) for m in METHODS for w in (2, 3)
    ]
    assert [r["ratio_to_2"] for r in rows if r["ranks"] == 2] == [1.0] * len(METHODS)
    assert all(r["median_ms"] > 0 and r["cpus"] >= 1 for r in rows), rows


def test_unknown_method_is_refused_naming_it(capsys):
    assert cli_main(["bench", "sync", "--methods", "ring"]) == 2
    assert f"bench sync --methods: 'ring' must be one of {METHODS} on this host" in capsys.readouterr().err
