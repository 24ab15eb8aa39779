"""Every captured log with an expectation sidecar gets the expected diagnosis, and conserves lines."""

from __future__ import annotations

import pytest

from logtriage.api import TriageOptions, triage
from logtriage.regress.cases import compare, find_cases
from tests.conftest import SAMPLES

CASES = find_cases(SAMPLES)


def test_there_are_samples_of_every_kind():
    kinds = {case.name.split("/", 1)[0] for case in CASES}
    assert {"cpu", "public"} <= kinds
    assert len(CASES) >= 60


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_sample_diagnosis(case):
    report = triage([str(case.log)], TriageOptions()).to_dict()
    problems = compare(case.expectation, report)
    if problems and case.expectation.known_miss:
        pytest.xfail(case.expectation.known_miss)
    assert problems == []
    rc = report["root_cause"]
    if case.expectation.verdict != "ok":
        assert rc is not None and rc["line"] is None or rc["source"] is not None


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_sample_conserves_lines(case):
    report = triage([str(case.log)], TriageOptions()).to_dict()
    assert report["input_lines"] == sum(s["lines"] for s in report["streams"])
    physical = 0
    paths = [case.log] if case.log.is_file() else sorted(p for p in case.log.rglob("*") if p.is_file())
    for path in paths:
        if path.name.endswith((".json",)):
            continue
        data = path.read_bytes()
        physical += data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
    assert report["input_lines"] == physical
