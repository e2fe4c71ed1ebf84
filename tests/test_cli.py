"""`epdraft` command line: configs by name from any directory, `check` pointing a parallel config
to `plan`, `--version`, the help's command list and `--log-level` on either side of the command."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from epdraft import cli
from epdraft.bench import SUBCOMMANDS
from epdraft.config.parallel import SHIPPED_CONFIGS, load_parallel_config

ASSETS = Path(__file__).resolve().parent.parent / "epdraft" / "assets"
SHIPPED_NAMES = ", ".join(sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.toml")))


def one_line_refusal(capsys, argv: list[str]) -> str:
    """Run `epdraft ARGV`; assert exit 2, one stderr line and no stdout; return the line."""
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and not out and len(err.strip().splitlines()) == 1, err + out
    return err.strip()


def test_plan_takes_a_shipped_config_by_name_outside_the_repository(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plan", "local-cpu-2", str(ASSETS / "tiny-draft")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("config local-cpu-2: draft.moe_ep = 2, draft.moe_tp = 1, draft.moe_layout = 'alltoall'\n")


@pytest.mark.parametrize(
    "argv",
    [["run", "local-cpu-9"], ["launch", "local-cpu-9", "--dry-run"], ["plan", "local-cpu-9", str(ASSETS / "tiny-draft")],
     ["bench", "dispatch", "--config", "local-cpu-9", "--rows", "4"]],
    ids=["run", "launch", "plan", "bench-dispatch"],
)  # fmt: skip
def test_an_unknown_config_name_lists_the_shipped_ones(capsys, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    assert one_line_refusal(capsys, argv) == (
        f"epdraft {argv[0]}: no config 'local-cpu-9': not a file, and the shipped configs are {SHIPPED_NAMES}"
    )


def test_launch_passes_the_name_on_to_the_workers(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["launch", "local-cpu-4", "--dry-run"]) == 0
    command = capsys.readouterr().out.strip()
    assert command.endswith("--nproc-per-node 4 --max-restarts 0 -m epdraft.worker --config local-cpu-4")


def test_run_default_config_is_the_shipped_local_cpu_2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parser = cli.build_parser("run")
    args = parser.parse_args(["run"])
    assert Path(args.config) == SHIPPED_CONFIGS / "local-cpu-2.toml"
    assert load_parallel_config(args.config) == load_parallel_config("local-cpu-2")


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    out, err = capsys.readouterr()
    assert e.value.code == 0 and not err
    assert out == f"epdraft {importlib.metadata.version('epdraft')}\n"


def test_version_without_package_metadata_says_so(capsys, monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and not out
    assert err == "epdraft --version: epdraft is not installed (no package metadata); pip install -e .\n"


def test_help_lists_every_bench_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0
    assert f"bench benchmarks: {', '.join(SUBCOMMANDS)}" in out
    assert list(SUBCOMMANDS) == ["dispatch", "iteration", "kernel", "linear", "step", "sync", "transfer"]


@pytest.mark.parametrize(
    "before, after, level",
    [([], [], "INFO"), (["--log-level", "warning"], [], "WARNING"), ([], ["--log-level", "ERROR"], "ERROR"),
     (["--log-level", "DEBUG"], ["--log-level", "ERROR"], "ERROR")],
    ids=["default", "before", "after", "after-wins"],
)  # fmt: skip
def test_log_level_before_or_after_the_command(capsys, tmp_path, monkeypatch, before, after, level):
    monkeypatch.chdir(tmp_path)
    configured = []
    monkeypatch.setattr(cli.logging, "basicConfig", lambda **kw: configured.append(kw["level"]))
    assert cli.main([*before, "launch", *after, "local-cpu-4", "--dry-run"]) == 0
    assert configured == [level]
    assert "--config local-cpu-4" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--log-level", "LOUD", "run"], ["run", "--log-level", "LOUD"]], ids=["before", "after"])
def test_a_bad_log_level_is_refused_on_either_side(capsys, argv):
    assert one_line_refusal(capsys, argv) == (
        "epdraft run: --log-level LOUD: expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL"
    )
