"""Render a LintResult as text (`path:line:col: ID message`), JSON, or SARIF 2.1.0."""

from __future__ import annotations

from pathlib import PurePath
from typing import Any
from urllib.parse import quote

import orjson

from logtriage import __version__
from logtriage.lint.model import LintResult, LintRule, Severity

SARIF_SCHEMA = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
SARIF_LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "note"}


def render(result: LintResult, fmt: str) -> str:
    if fmt == "json":
        return orjson.dumps(as_json(result), option=orjson.OPT_INDENT_2).decode() + "\n"
    if fmt == "sarif":
        return orjson.dumps(as_sarif(result), option=orjson.OPT_INDENT_2).decode() + "\n"
    return as_text(result)


def as_text(result: LintResult) -> str:
    lines = [f"{f.path}:{f.line}:{f.col}: {f.rule_id} {f.message}" for f in result.findings]
    counts = result.counts()
    if result.findings:
        parts = ", ".join(f"{n} {sev}" for sev, n in counts.items() if n)
        lines.append(f"Found {len(result.findings)} finding(s) ({parts}) in {result.files_checked} file(s).")
    else:
        lines.append(f"No findings in {result.files_checked} file(s).")
    return "\n".join(lines) + "\n"


def problems_text(result: LintResult) -> str:
    return "".join(f"{p.path}:{p.line}: {p.message}\n" for p in result.problems)


def as_json(result: LintResult) -> dict[str, Any]:
    return {
        "tool": "triage lint",
        "version": __version__,
        "files_checked": result.files_checked,
        "summary": result.counts(),
        "findings": [f.to_dict() for f in result.findings],
        "problems": [{"path": p.path, "line": p.line, "message": p.message} for p in result.problems],
        "rules": [r.id for r in result.rules],
    }


def _uri(path: str) -> str:
    pure = PurePath(path)
    if pure.is_absolute():
        return "file://" + quote(pure.as_posix())
    return quote(pure.as_posix())


def _descriptor(rule: LintRule) -> dict[str, Any]:
    docs = rule.docs
    markdown = (f"**What it catches.** {docs.what}\n\n**Why it hangs or crashes.** {docs.why}\n\n"
                f"**Example**\n\n```\n{docs.example.rstrip()}\n```\n\n**Fix.** {docs.fix}")
    return {
        "id": rule.id,
        "name": rule.name,
        "shortDescription": {"text": rule.title},
        "fullDescription": {"text": docs.what},
        "help": {"text": f"{docs.why}\nFix: {docs.fix}", "markdown": markdown},
        "defaultConfiguration": {"level": SARIF_LEVEL[rule.severity]},
        "properties": {"prevents": list(rule.prevents), "helps_diagnose": list(rule.helps_diagnose),
                       "tags": ["distributed", "pytorch", rule.kind.value]},
    }


def as_sarif(result: LintResult) -> dict[str, Any]:
    rules = list(result.rules)
    index = {r.id: i for i, r in enumerate(rules)}
    results = [{
        "ruleId": f.rule_id,
        "ruleIndex": index[f.rule_id],
        "level": SARIF_LEVEL[f.severity],
        "message": {"text": f.message},
        "locations": [{"physicalLocation": {
            "artifactLocation": {"uri": _uri(f.path)},
            "region": {"startLine": f.line, "startColumn": f.col},
        }}],
    } for f in result.findings if f.rule_id in index]
    notes = []
    for p in result.problems:
        location: dict[str, Any] = {"artifactLocation": {"uri": _uri(p.path)}}
        if p.line > 0:
            location["region"] = {"startLine": p.line}
        notes.append({"level": "warning", "message": {"text": p.message},
                      "locations": [{"physicalLocation": location}]})
    return {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "triage-lint", "version": __version__,
                                "rules": [_descriptor(r) for r in rules]}},
            "invocations": [{"executionSuccessful": True, "toolExecutionNotifications": notes}],
            "columnKind": "unicodeCodePoints",
            "results": results,
        }],
    }
