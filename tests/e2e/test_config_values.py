"""Every layout, backend and mode value the config schema accepts, set on the CPU config: `epdraft
run` either runs it losslessly, or refuses it at validation (exit 2, before any rank starts)
naming the key. Never a failure at build time inside the ranks."""

from __future__ import annotations

import typing

import pytest

from epdraft.config.parallel import DraftConfig
from tests.e2e.test_run import run_epdraft

MODE_KEYS = ("moe_layout", "a2a_backend", "dp_padding", "low_latency", "cuda_graphs")


def _schema_values() -> list[tuple[str, object]]:
    """(key, value) for every value of the draft section's layout/backend/mode fields."""
    hints = typing.get_type_hints(DraftConfig, include_extras=True)
    out = []
    for key in MODE_KEYS:
        hint = hints[key]
        while typing.get_origin(hint) is typing.Annotated:
            hint = typing.get_args(hint)[0]
        values = (False, True) if hint is bool else typing.get_args(hint)
        assert values, f"draft.{key}: not a Literal or bool field"
        out += [(key, v) for v in values]
    return out


def _toml(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else f'"{value}"'


def test_schema_values_cover_the_documented_backends():
    values = dict.fromkeys(k for k, _ in _schema_values())
    assert set(values) == set(MODE_KEYS)
    assert ("a2a_backend", "mooncake") in _schema_values() and ("low_latency", True) in _schema_values()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("key,value", _schema_values(), ids=lambda v: str(v))
def test_every_schema_value_runs_or_is_refused_at_validation(key, value, tmp_path):
    override = f"draft.{key}={_toml(value)}"
    proc, summary = run_epdraft(["--set", override, "--max-prompts", "3", "--max-new-tokens", "8"], tmp_path)
    if proc.returncode == 0:
        assert summary is not None and summary["lossless"] is True, proc.stdout
        assert "lossless: OK" in proc.stdout
        return
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "[rank " not in proc.stderr, f"{override} was refused inside the ranks, not at validation:\n{proc.stderr}"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert f"draft.{key}" in lines[-1], proc.stderr
