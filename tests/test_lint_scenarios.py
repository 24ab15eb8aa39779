"""`triage lint` over the project's own fault-injection scripts: it flags exactly the scripts
whose scenarios declare a code bug (`Scenario.code_bugs`), with the matching rule, and nothing
in the others (the healthy control included)."""

from __future__ import annotations

from pathlib import Path

import pytest

from logtriage.lint.engine import lint_paths

inject = pytest.importorskip("logtriage.inject.registry")

SCENARIO_DIR = Path(inject.__file__).parent / "scenarios"
# The lint rule that catches each declared kind of code bug.
RULE_FOR_BUG = {
    "collective_in_rank_branch": "DDP101",
    "save_without_barrier": "CKP302",
}


def expected_rules() -> dict[str, set[str]]:
    """Script file name -> the lint rules its scenarios' declared bugs call for."""
    out: dict[str, set[str]] = {p.name: set() for p in SCENARIO_DIR.glob("*.py")}
    for scenario in inject.all_scenarios():
        out.setdefault(scenario.script, set()).update(RULE_FOR_BUG[b.value] for b in scenario.code_bugs)
    return out


@pytest.mark.parametrize("script", sorted(expected_rules()), ids=str)
def test_scenario_script_lints_as_declared(script: str) -> None:
    result = lint_paths([str(SCENARIO_DIR / script)])
    assert not result.problems
    fired = {f.rule_id for f in result.findings}       # every severity, info included
    assert fired == expected_rules()[script], [f"{f.line}: {f.rule_id} {f.message}" for f in result.findings]


def test_every_declared_bug_has_a_rule_and_the_control_is_clean() -> None:
    declared = {b.value for s in inject.all_scenarios() for b in s.code_bugs}
    assert declared <= set(RULE_FOR_BUG), declared - set(RULE_FOR_BUG)
    flagged = {script for script, rules in expected_rules().items() if rules}
    assert {"rank0_collective.py", "skip_collective.py", "ckpt_no_barrier.py"} <= flagged
    assert lint_paths([str(SCENARIO_DIR / "healthy.py")]).findings == ()
