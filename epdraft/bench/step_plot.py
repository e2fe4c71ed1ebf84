"""`bench step --plot`: graph step time and floor against N, drawn from the bench's rows (or a saved `--json`
file), with matplotlib on its file-only backend (`pip install 'epdraft[plot]'`)."""

from __future__ import annotations

import json
from pathlib import Path

from epdraft.errors import ConfigError


def pyplot(path: Path):
    """matplotlib's pyplot on the file-only Agg backend, after checking that `path` can be written."""
    if not path.parent.is_dir():
        raise ConfigError(f"--plot {path}: directory {path.parent} does not exist")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError("--plot needs matplotlib: pip install 'epdraft[plot]'") from e
    return plt


def read_results(path: Path) -> list[dict]:
    """The JSON lines a `--json` file holds (blank lines skipped); ConfigError naming file and line."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"--from-json {path}: cannot read it ({e.strerror})") from e
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{i}: not a JSON line of `epdraft bench step --json` ({e.msg})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def plot(plt, results: list[dict], path: Path, kind: str = "step", what: str = "draft step") -> None:
    """Graph ms and floor ms against N, one pair of lines per (preset, context), of the rows of
    `kind` (`graph_ms`, `floor_ms`; `bench iteration`'s are "iteration"): "step" rows are those
    without `kind` (files written before it existed) or with kind "step"; other rows (attention)
    are left out. A point measured twice (runs appended to one file) keeps the last. A draft timed
    with other weights than bf16 (`--weights quantized`) is its own line.
    """
    points: dict[tuple[str, int], dict[int, dict]] = {}
    devices = set()
    for r in results:
        if r.get("kind", "step") != kind:
            continue
        devices.add(str(r.get("device", "")))
        try:
            preset = str(r["preset"]) + ("" if r.get("weights", "bf16") == "bf16" else f" {r['weights']}")
            points.setdefault((preset, int(r["context"])), {})[int(r["requests"])] = {
                "graph_ms": float(r["graph_ms"]), "floor_ms": float(r["floor_ms"])}  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"--plot: a {kind} row without preset, context, requests, graph_ms, floor_ms: {r}") from e
    if not points:
        raise ConfigError(f"--plot {path}: no {kind} results to draw (other rows are not plotted)")
    presets = sorted({preset for preset, _ in points})
    fig, ax = plt.subplots(figsize=(7, 4))
    for (preset, context), by_n in sorted(points.items()):
        n = sorted(by_n)
        label = f"ctx {context}" if len(presets) == 1 else f"{preset}, ctx {context}"
        (line,) = ax.plot(n, [by_n[i]["graph_ms"] for i in n], "o-", label=f"graph, {label}")
        ax.plot(n, [by_n[i]["floor_ms"] for i in n], "--", color=line.get_color(), label=f"floor, {label}")
    devices.discard("")
    ax.set_title(f"{what}: {', '.join(presets)}" + (f" on {', '.join(sorted(devices))}" if devices else ""))
    ax.set_xlabel("requests N")
    ax.set_ylabel(f"ms per {what}")
    ax.set_xscale("log", base=2)
    all_n = sorted({i for by_n in points.values() for i in by_n})
    ax.set_xticks(all_n, [str(i) for i in all_n])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"plot: {path}")
