"""alltoall layout (torch backend) on gloo equals the single-process DraftMoE."""

from __future__ import annotations

import pytest

from tests.dispatch.moe_world import alltoall_cases, run_cases
from tests.harness import run_ranks

STEPS = 50


@pytest.mark.timeout(120)
def test_alltoall_equals_reference_on_4_ranks():
    cases = alltoall_cases(4)
    assert {c[3] for c in cases} == {2, 4}
    reports = run_ranks(4, run_cases, cases, STEPS, timeout_s=110)
    for rank, report in enumerate(reports):
        assert len(report) == len(cases)
        for case, r in report.items():
            assert r["compared"] > 0 and r["skipped"] > 0, (rank, case, r)
            assert r["worst"] <= 1e-5, (rank, case, r)


@pytest.mark.timeout(120)
def test_fixed_capacity_alltoall_equals_reference_on_4_ranks():
    cases = alltoall_cases(4, backend="torch_fixed")
    reports = run_ranks(4, run_cases, cases, STEPS, timeout_s=110)
    for rank, report in enumerate(reports):
        assert len(report) == len(cases)
        for case, r in report.items():
            assert r["compared"] > 0 and r["skipped"] > 0 and r["idle"] > 0, (rank, case, r)
            assert r["worst"] <= 1e-5, (rank, case, r)
