"""`epdraft bench dispatch`: a table on stdout, JSON lines only in the `--json` file."""

from __future__ import annotations

import json

import pytest

from epdraft.cli import main as cli_main


@pytest.mark.timeout(120)
def test_stdout_is_the_table_and_json_goes_to_the_file(capsys, tmp_path):
    out = tmp_path / "dispatch.jsonl"
    argv = ["bench", "dispatch", "--config", "local-cpu-2", "--rows", "2", "--steps", "1", "--warmup", "0"]
    assert cli_main([*argv, "--json", str(out)]) == 0
    stdout = capsys.readouterr().out.splitlines()
    assert stdout[0].startswith("2 CPU ranks, moe_ep = 2, moe_tp = 1, 2 rows/rank"), stdout
    assert stdout[1].split() == ["layout", "sync", "dispatch", "experts", "combine", "step"]
    assert not [line for line in stdout if line.startswith("{")], stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["layout"] for r in rows] == ["replicated", "alltoall", "gather", "gather"], rows
    assert all(r["bench"] == "dispatch" and r["rows_per_rank"] == 2 for r in rows)
