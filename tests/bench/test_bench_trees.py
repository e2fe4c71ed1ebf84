"""tools/bench_trees.py: one bench run in several trees, rounds in alternating order, the medians
compared; checked with stand-in trees whose `epdraft.cli` writes known JSON rows."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_trees.py"

# A stand-in `python -m epdraft.cli ... --json FILE`: appends a row per request count, its graph_ms
# the tree's base times the count plus the run's index (so the median over rounds is known), and
# records the order the trees ran in.
FAKE_CLI = """
import json, sys
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--json") + 1])
base = {base}
if base < 0:
    print("stand-in bench failed", file=sys.stderr)
    sys.exit(3)
order = Path({order!r})
runs = order.read_text().count("{name}") if order.exists() else 0
order.write_text((order.read_text() if order.exists() else "") + "{name} ")
print("a table line")
with out.open("a") as f:
    for n in (1, 8):
        f.write(json.dumps(dict(kind="iteration", preset="p", requests=n, context=1024, graph_ms=base * n + runs)) + "\\n")
"""


def _tool():
    spec = importlib.util.spec_from_file_location("bench_trees", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tree(root: Path, name: str, base: float, order: Path) -> Path:
    tree = root / name
    (tree / "epdraft").mkdir(parents=True)
    (tree / "epdraft" / "__init__.py").write_text("")
    (tree / "epdraft" / "cli.py").write_text(FAKE_CLI.format(base=base, order=str(order), name=name))
    return tree


def test_rounds_alternate_the_order_and_the_table_compares_medians(tmp_path, capsys):
    order = tmp_path / "order"
    before, after = _tree(tmp_path, "before", 2.0, order), _tree(tmp_path, "after", 1.5, order)
    out = tmp_path / "out"
    rc = _tool().main(["--rounds", "3", "--out", str(out), str(before), str(after), "--", "bench", "iteration"])
    assert rc == 0
    assert order.read_text().split() == ["before", "after", "after", "before", "before", "after"]
    rows = [json.loads(line) for line in (out / "after.jsonl").read_text().splitlines()]
    assert [r["graph_ms"] for r in rows if r["requests"] == 8] == [12.0, 13.0, 14.0]
    printed = capsys.readouterr().out
    # medians over the 3 rounds (runs 0, 1, 2 added): before 2 + 1, 16 + 1; after 1.5 + 1, 12 + 1
    assert "kind=iteration preset=p requests=1 context=1024: before 3 [2-4], after 2.5 [1.5-3.5] (0.833x)" in printed
    assert "kind=iteration preset=p requests=8 context=1024: before 17 [16-18], after 13 [12-14] (0.765x)" in printed
    assert "a table line" in printed and "a table line" in (out / "log").read_text()


def test_a_failing_tree_is_named_and_the_others_still_run(tmp_path, capsys):
    order = tmp_path / "order"
    good, bad = _tree(tmp_path, "good", 1.0, order), _tree(tmp_path, "bad", -1, order)
    rc = _tool().main(["--rounds", "1", "--out", str(tmp_path / "out"), str(bad), str(good), "--", "bench", "step"])
    assert rc == 1
    printed = capsys.readouterr().out
    assert "stand-in bench failed" in printed and "bad: the bench exited with 3" in printed
    assert "requests=1 context=1024: bad -, good 1" in printed and printed.rstrip().endswith("failed: bad")


@pytest.mark.parametrize("argv,why", [
    (["x", "--", "bench"], "not a tree of the repo (no epdraft/cli.py): x"),
    (["."], "usage: bench_trees.py"),
    ([".", "--"], "no bench command after --"),
    (["--rounds", "0", ".", "--", "bench"], "--rounds must be >= 1"),
])  # fmt: skip
def test_bad_arguments_are_refused_in_one_line(argv, why, capsys, monkeypatch):
    monkeypatch.chdir(TOOL.parents[1])
    assert _tool().main(argv) == 2
    assert why in capsys.readouterr().err
