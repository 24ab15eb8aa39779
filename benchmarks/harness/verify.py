"""Compare one `triage --format json` report with the generated log's *.expect.toml.

A fast wrong answer is no answer: the runner keeps one report per size and says whether its
root cause has the injected rule, rank and line. The JSON contract is read tolerantly: the root
cause is `root_cause` (or `root`), its rule `rule_id` (or `rule`), its line `line`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping


def _root(report: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for key in ("root_cause", "root"):
        value = report.get(key)
        if isinstance(value, Mapping):
            return value
    return None


def check_report(report_path: Path, expect: Mapping[str, Any]) -> str:
    """A short verdict for the results table, e.g. `✓ cuda.oom rank 17 line 1088269`."""
    try:
        report = json.loads(report_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"✗ unreadable JSON ({exc.__class__.__name__})"
    if not isinstance(report, Mapping):
        return "✗ JSON is not an object"
    verdict = report.get("verdict")
    if expect.get("verdict") == "ok":
        return "✓ ok" if verdict == "ok" else f"✗ verdict {verdict!r}, expected 'ok'"
    root = _root(report)
    if root is None:
        return f"✗ no root cause (verdict {verdict!r})"
    got_rule = root.get("rule_id", root.get("rule"))
    problems = []
    if expect.get("rule") and got_rule != expect["rule"]:
        problems.append(f"rule {got_rule} ≠ {expect['rule']}")
    if "rank" in expect and root.get("rank") != expect["rank"]:
        problems.append(f"rank {root.get('rank')} ≠ {expect['rank']}")
    if expect.get("line") and root.get("line") != expect["line"]:
        problems.append(f"line {root.get('line')} ≠ {expect['line']}")
    if problems:
        return "✗ " + ", ".join(problems)
    return f"✓ {got_rule} rank {root.get('rank')} line {root.get('line')}"
