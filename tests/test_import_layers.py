"""DESIGN.md's layer order, enforced: every import in epdraft/ (module level or inside a function)
goes down the list, no two packages import each other, no two files import each other (through any
chain), and kernels import nothing but errors.

    cli, launch, run, check, preflight, bench  ->  worker  ->  runtime  ->  parallel, models, target
        ->  layers, dispatch, loading, kernels, sampling  ->  config  ->  errors
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "epdraft"

TIERS: tuple[tuple[str, ...], ...] = (
    ("cli", "launch", "run", "check", "preflight", "bench"),
    ("worker",),
    ("runtime",),
    ("parallel", "models", "target"),
    ("layers", "dispatch", "loading", "kernels", "sampling"),
    ("config",),
    ("errors",),
)
TIER = {unit: i for i, units in enumerate(TIERS) for unit in units}


def _unit(module: str) -> str | None:
    """`epdraft.worker.job` -> `worker`; None for the root package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "epdraft" else None


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path, package: str | None = None) -> list[tuple[int, str]]:
    """(line, imported module) for every absolute or relative import of epdraft in `path`
    (`package`: the one relative imports resolve against, by default the file's own)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    if package is None:
        package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("epdraft")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.startswith("epdraft"):
                found.append((node.lineno, module))
    return sorted(found)


def _edges() -> list[tuple[str, int, str, str]]:
    """(file, line, importing unit, imported unit) for every cross-unit import."""
    edges = []
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = _unit(_module_name(path))
        if unit is None:  # epdraft/__init__.py re-exports the runtime lazily
            continue
        for line, module in _imports(path):
            target = _unit(module)
            if target is not None and target != unit:
                edges.append((str(path.relative_to(PACKAGE.parent)), line, unit, target))
    return edges


def test_every_unit_has_a_tier():
    units = {_unit(_module_name(p)) for p in PACKAGE.rglob("*.py")} - {None}
    assert units <= set(TIER), f"add {sorted(units - set(TIER))} to TIERS (and to the README's layer order)"


def test_no_import_runs_up_a_layer():
    upward = [f"{f}:{line}: {u} imports {t}" for f, line, u, t in _edges() if TIER[t] < TIER[u]]
    assert not upward, "imports that run up DESIGN.md's layer order:\n" + "\n".join(upward)


def test_no_two_packages_import_each_other():
    pairs = {(u, t) for _, _, u, t in _edges()}
    mutual = sorted({tuple(sorted(p)) for p in pairs if (p[1], p[0]) in pairs})
    assert not mutual, f"packages importing each other: {mutual}"


def _module_graph() -> dict[str, set[str]]:
    """module -> the epdraft modules it imports (module level or inside a function), a package's
    name standing for its `__init__.py`; `from epdraft.x import y` counts as importing epdraft.x.y
    when that is a module, else epdraft.x."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}

    def known(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for line, module in _imports(path, package):
            targets.add(known(module))
        for node in ast.walk(tree):  # `from epdraft.x import submodule`
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("epdraft"):
                targets |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
        graph[name] = targets - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_file_level_import_cycle():
    """No module imports (directly or through others, function-level imports included) one that
    imports it back: each file can be read, tested and moved on its own."""
    cycles = _cycles(_module_graph())
    assert not cycles, "import cycles between files:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle():
    """The checker itself, on a graph with one cycle of three and a tail."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_kernels_import_only_errors():
    """Kernels take plain ints and tensors: no config Struct, loader, layer or model reaches them,
    so a kernel family is usable (and testable) without the rest of the package."""
    bad = [f"{f}:{line}: kernels imports {t}" for f, line, u, t in _edges() if u == "kernels" and t != "errors"]
    assert not bad, "kernels importing packages other than errors:\n" + "\n".join(bad)


def test_the_walk_sees_upward_and_function_level_imports(tmp_path):
    """The checker itself: an import inside a function and a relative import are both found."""
    path = PACKAGE / "layers" / "moe.py"
    found = {m for _, m in _imports(path)}
    assert "epdraft.dispatch" in found and "epdraft.loading" in found
    sample = tmp_path / "x.py"
    sample.write_text("def f():\n    from epdraft.worker.job import RunJob\n\nfrom ..runtime import draft\n")
    assert _imports(sample, "epdraft.layers") == [(2, "epdraft.worker.job"), (4, "epdraft.runtime")]


@pytest.mark.parametrize("module", ["epdraft", "epdraft.errors", "epdraft.cli"])
def test_light_imports_load_no_torch(module):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"import {module} loaded {out.strip()}"


def test_the_runtime_imports_with_the_core_dependencies_alone():
    """What an engine embeds needs neither transformers nor PyYAML (extras `[hf]`, `[yaml]`): both are
    made unimportable, and `epdraft.runtime` with everything it imports still loads."""
    code = ("import sys; sys.modules['transformers'] = None; sys.modules['yaml'] = None; "
            "import epdraft.runtime, epdraft.models, epdraft.layers, epdraft.sampling, epdraft.config; print('ok')")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
