"""gather layout (max_len and sum_len) on gloo equals the single-process DraftMoE."""

from __future__ import annotations

import pytest

from tests.dispatch.moe_world import gather_cases, run_cases
from tests.harness import run_ranks

STEPS = 50


def _check(reports: list[dict], cases: list[tuple]) -> None:
    for rank, report in enumerate(reports):
        assert len(report) == len(cases)
        for case, r in report.items():
            assert r["compared"] > 0 and r["skipped"] > 0, (rank, case, r)
            assert r["worst"] <= 1e-5, (rank, case, r)


@pytest.mark.timeout(150)
def test_gather_equals_reference_on_4_ranks():
    cases = gather_cases(4)
    assert len(cases) == 16
    _check(run_ranks(4, run_cases, cases, STEPS, timeout_s=140), cases)


@pytest.mark.timeout(90)
def test_gather_equals_reference_on_2_ranks():
    cases = gather_cases(2)
    assert {(c[3], c[4]) for c in cases} == {(2, 1), (1, 2)}
    _check(run_ranks(2, run_cases, cases, STEPS, timeout_s=80), cases)
