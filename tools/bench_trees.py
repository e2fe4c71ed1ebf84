"""Time one `epdraft` bench in several trees side by side, in one device call, and compare them.

    python tools/bench_trees.py [--rounds 2] [--metric graph_ms] [--out DIR] TREE [TREE ...] -- bench iteration ...

TREE: a directory holding a copy of the repo: `.` for this checkout, others exported before the
device call (`git archive REV | tar -x -C scratch/REV`: untracked, so the device run carries them).
Each round runs the bench command in every tree in turn, the order reversed every other round so
that drift over the run falls on every tree alike, each appending its JSON lines to
OUT/<tree>.jsonl (its other output to OUT/log and the terminal). Then, per point (kind, preset,
weights, shape, tokens, requests, context), the metric's median over the rounds in each tree, its
least and most over them (the run's noise, beside the ratio it qualifies) and its ratio to the first
tree's. A tree whose bench fails is named and the rest still run; the exit
status is then 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

POINT_KEYS = ("kind", "preset", "weights", "shape", "tokens", "requests", "context")


def _name(tree: Path) -> str:
    return tree.resolve().name if str(tree) != "." else "this"


def run_round(trees: list[Path], command: list[str], out: Path, log) -> list[str]:
    """The bench in every tree, in order; the names of the trees whose bench failed."""
    failed = []
    for tree in trees:
        jsonl = out / f"{_name(tree)}.jsonl"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in ("/tmp/site", str(tree.resolve())) if Path(p).exists()))
        print(f"=== {_name(tree)} ({tree}): epdraft {' '.join(command)}", file=log, flush=True)
        proc = subprocess.run([sys.executable, "-m", "epdraft.cli", *command, "--json", str(jsonl.resolve())], cwd=tree,
                              env=env, capture_output=True, text=True)  # fmt: skip
        for line in (proc.stdout + proc.stderr).splitlines():
            if not line.startswith("{"):
                print(line, file=log, flush=True)
        if proc.returncode:
            print(f"=== {_name(tree)}: the bench exited with {proc.returncode}", file=log, flush=True)
            failed.append(_name(tree))
    return failed


def table(names: list[str], out: Path, metric: str) -> list[str]:
    """Lines: per point, the metric's median over rounds in each tree, its least-most, and the ratio
    of its median to the first tree's."""
    rounds: dict[tuple, dict[str, list[float]]] = {}  # point -> tree -> the metric in each round
    for name in names:
        path = out / f"{name}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        by_point: dict[tuple, list[float]] = {}
        for row in rows:
            if isinstance(row.get(metric), (int, float)):
                point = tuple((k, row[k]) for k in POINT_KEYS if k in row)
                by_point.setdefault(point, []).append(row[metric])
        for point, values in by_point.items():
            rounds.setdefault(point, {})[name] = values
    lines = [f"{metric}, median over rounds [least-most where several] (ratio of medians to {names[0]}):"]
    for point, per_tree in rounds.items():
        label = " ".join(f"{k}={v}" for k, v in point)
        base = statistics.median(per_tree[names[0]]) if names[0] in per_tree else None
        cells = []
        for name in names:
            values = per_tree.get(name)
            if values is None:
                cells.append(f"{name} -")
                continue
            value = statistics.median(values)
            spread = f" [{min(values):.4g}-{max(values):.4g}]" if len(values) > 1 else ""
            ratio = f" ({value / base:.3f}x)" if base and name != names[0] else ""
            cells.append(f"{name} {value:.4g}{spread}{ratio}")
        lines.append(f"  {label}: " + ", ".join(cells))
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: bench_trees.py [--rounds R] [--metric KEY] [--out DIR] TREE [TREE ...] -- BENCH ARGS",
              file=sys.stderr)  # fmt: skip
        return 2
    cut = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trees", nargs="+", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--metric", default="graph_ms", help="the JSON field compared (default graph_ms)")
    parser.add_argument("--out", type=Path, default=Path("bench-trees"))
    args = parser.parse_args(argv[:cut])
    command = argv[cut + 1 :]
    missing = [str(t) for t in args.trees if not (t / "epdraft" / "cli.py").is_file()]
    names = [_name(t) for t in args.trees]
    if missing or not command or args.rounds < 1 or len(set(names)) != len(names):
        why = (f"not a tree of the repo (no epdraft/cli.py): {', '.join(missing)}" if missing else
               "no bench command after --" if not command else "--rounds must be >= 1" if args.rounds < 1 else
               f"two trees share a name: {names}")  # fmt: skip
        print(f"bench_trees.py: {why}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    failed: set[str] = set()
    with open(args.out / "log", "a") as log_file:
        tee = _Tee(sys.stdout, log_file)
        for r in range(args.rounds):
            order = args.trees if r % 2 == 0 else args.trees[::-1]
            print(f"=== round {r + 1} of {args.rounds}", file=tee, flush=True)
            failed.update(run_round(order, command, args.out, tee))
        for line in table(names, args.out, args.metric):
            print(line, file=tee)
        if failed:
            print(f"failed: {', '.join(sorted(failed))}", file=tee)
    return 1 if failed else 0


class _Tee:
    """A file that writes to two."""

    def __init__(self, *files):
        self.files = files

    def write(self, text: str) -> None:
        for f in self.files:
            f.write(text)

    def flush(self) -> None:
        for f in self.files:
            f.flush()


if __name__ == "__main__":
    sys.exit(main())
