"""Every lint rule against its annotated fixtures: `# ruleid: X` marks the line before an expected
finding of X, `# ok: X` the line before a near miss that must not fire (semgrep style)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from logtriage.lint.engine import lint_paths
from logtriage.lint.model import Severity
from logtriage.lint.registry import all_rules, get_rule, rules_linked, rules_preventing, select_rules

FIXTURES = Path(__file__).parent / "lint_fixtures"
ROOT = Path(__file__).parent.parent
ANNOTATION = re.compile(r"#\s*(ruleid|ok):\s*([A-Z]{2,4}\d{3})\b")
FIXTURE_FILES = sorted(p for p in FIXTURES.iterdir() if p.is_file() and re.match(r"[A-Z]{2,4}\d{3}_", p.name))


def annotations(path: Path) -> dict[str, dict[str, set[int]]]:
    """rule id -> {"ruleid": lines, "ok": lines}; an annotation applies to the next code line."""
    lines = path.read_text().splitlines()
    out: dict[str, dict[str, set[int]]] = {}
    for index, line in enumerate(lines):
        match = ANNOTATION.search(line)
        if not match or not line.lstrip().startswith("#"):
            continue
        target = index + 1
        while target < len(lines) and (not lines[target].strip() or lines[target].lstrip().startswith("#")):
            target += 1
        out.setdefault(match.group(2), {"ruleid": set(), "ok": set()})[match.group(1)].add(target + 1)
    return out


def finding_lines(path: Path) -> dict[str, set[int]]:
    result = lint_paths([str(path)])
    assert not result.problems, result.problems
    got: dict[str, set[int]] = {}
    for finding in result.findings:
        got.setdefault(finding.rule_id, set()).add(finding.line)
    return got


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name)
def test_fixture_fires_exactly_where_annotated(path: Path) -> None:
    marks = annotations(path)
    own = path.name.split("_", 1)[0]
    assert own in marks, f"{path.name} has no annotation for its own rule {own}"
    got = finding_lines(path)
    for rule_id, mark in marks.items():
        found = got.get(rule_id, set())
        assert found == mark["ruleid"], (
            f"{rule_id} in {path.name}: fired on {sorted(found)}, annotated {sorted(mark['ruleid'])}")
        assert not found & mark["ok"], f"{rule_id} fired on near-miss lines {sorted(found & mark['ok'])}"
    unannotated = {rule_id: sorted(lines) for rule_id, lines in got.items() if rule_id not in marks}
    assert unannotated == {}, f"{path.name}: rules fired where nothing is annotated"


@pytest.mark.parametrize("rule", all_rules(), ids=lambda r: r.id)
def test_rule_is_a_complete_unit(rule) -> None:
    assert (FIXTURES / rule.fixture) in FIXTURE_FILES, f"{rule.id}: fixture {rule.fixture} missing"
    fire = sum(len(annotations(p).get(rule.id, {}).get("ruleid", ())) for p in FIXTURE_FILES)
    miss = sum(len(annotations(p).get(rule.id, {}).get("ok", ())) for p in FIXTURE_FILES)
    assert fire >= 1 and miss >= 1, f"{rule.id}: needs must-fire and must-not-fire examples ({fire}, {miss})"
    docs = rule.describe()["docs"]
    assert set(docs) == {"what", "why", "example", "fix"} and all(len(v) > 20 for v in docs.values())
    assert rule.prevents or rule.helps_diagnose or "prevents nothing" in rule.docs.why


def catalog_ids() -> set[str]:
    text = (ROOT / "docs" / "catalog.md").read_text()
    table = text[text.index("## Rule ids"):]
    return set(re.findall(r"`([a-z]+\.[a-z0-9_]+)`", table))


@pytest.mark.parametrize("rule", all_rules(), ids=lambda r: r.id)
def test_linked_runtime_ids_exist_in_the_catalog(rule) -> None:
    known = catalog_ids()
    assert set(rule.prevents) <= known, set(rule.prevents) - known
    assert set(rule.helps_diagnose) <= known, set(rule.helps_diagnose) - known


def test_registry_interface_for_explain() -> None:
    assert get_rule("DDP101").name == "collective-in-rank-branch"
    assert get_rule("ddp101") is get_rule("collective-in-rank-branch")
    assert get_rule("gloo.timeout") is None
    assert "DDP101" in [r.id for r in rules_preventing("gloo.timeout")]
    assert "CKP301" in [r.id for r in rules_preventing("ckpt.corrupt_archive")]
    assert rules_preventing("signal.sigsegv") == ()
    assert [r.id for r in rules_linked("signal.sigsegv")] == ["LNC402"]
    data = get_rule("CKP301").describe()
    assert {"id", "name", "title", "severity", "prevents", "docs"} <= set(data)
    assert data["severity"] == "error" and data["prevents"] == ["ckpt.corrupt_archive", "ckpt.not_found"]
    json.dumps([r.describe() for r in all_rules()])     # plain data only


def test_select_and_ignore_codes() -> None:
    assert [r.id for r in select_rules(["CKP"])] == ["CKP301", "CKP302", "CKP303", "CKP304"]
    assert [r.id for r in select_rules(["save-on-every-rank"])] == ["CKP301"]
    chosen = [r.id for r in select_rules(None, ["DDP1", "LNC"])]
    assert chosen == ["CKP301", "CKP302", "CKP303", "CKP304", "PG201"]
    assert {r.severity for r in all_rules()} == set(Severity)
