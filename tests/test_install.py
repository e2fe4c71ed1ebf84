"""The core install is what `epdraft.runtime` needs and nothing more: in a fresh venv without the
system's packages, torch plus pyproject's [project].dependencies import the runtime, and neither
transformers nor PyYAML (the `[hf]` and `[yaml]` extras) is there. Runs in CI like any CPU test;
skips, saying why, where the venv cannot get torch's CPU build (no wheel reachable, or a CUDA one)."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"


# No PYTHONPATH: the venv must import only what was installed into it.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _pip(python: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    cmd = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)


def _last_line(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit code {proc.returncode}"


@pytest.mark.timeout(300)
def test_core_install_imports_the_runtime_without_transformers_or_yaml(tmp_path):
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(tmp_path / "venv")
    python = tmp_path / "venv" / "bin" / "python"
    # This machine's pip resolves torch from its local wheels; elsewhere the CPU index is the README's command.
    torch = _pip(python, TORCH, timeout=150)
    if torch.returncode != 0:
        pytest.skip(f"pip install {TORCH} in a fresh venv failed (no wheel reachable here?): {_last_line(torch)}")
    cuda = subprocess.run([str(python), "-c", "import torch; print(torch.version.cuda)"], capture_output=True,
                          text=True, timeout=60, env=ENV)  # fmt: skip
    if cuda.stdout.strip() != "None":
        found = cuda.stdout.strip() or _last_line(cuda)
        pytest.skip(f"pip install {TORCH} gave a CUDA build ({found}), not the CPU one")
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    core = [d for d in pyproject["project"]["dependencies"] if not d.startswith("torch")]
    # The build backend too: the package is built here without isolation (no second download of setuptools).
    deps = _pip(python, *core, *pyproject["build-system"]["requires"], timeout=90)
    assert deps.returncode == 0, deps.stderr
    package = _pip(python, "--no-deps", "--no-build-isolation", "-e", str(REPO), timeout=60)
    assert package.returncode == 0, package.stderr
    probe = ("import importlib.util, epdraft.runtime; "
             "print([m for m in ('transformers', 'yaml') if importlib.util.find_spec(m) is not None])")  # fmt: skip
    # Outside the repo, so the import is the installed package's (the editable finder), not the cwd's.
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=ENV)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
