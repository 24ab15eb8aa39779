"""Values of the linter: a rule (data, docs, check), a finding, the result of one run.

A lint rule is one unit, like a catalog rule: a stable id (``DDP101``), a slug name, a title,
a severity, its docs (what it catches, why it hangs or crashes, an example, the fix), the runtime
catalog rule ids whose failures it prevents, and an annotated fixture under
``tests/lint_fixtures/`` whose ``# ruleid:`` / ``# ok:`` lines say where it must and must not fire.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterable


class Severity(str, Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def weight(self) -> int:
        """Larger is more severe; `--fail-on X` fails on findings whose weight >= X's."""
        return {"error": 3, "warning": 2, "info": 1}[self.value]


class FileKind(str, Enum):
    """What a rule reads: Python source (AST) or a launch script / job template (text)."""

    PYTHON = "python"
    TEMPLATE = "template"


@dataclass(frozen=True)
class RuleDocs:
    what: str       # what it catches
    why: str        # why it hangs or crashes
    example: str    # a short snippet that fires
    fix: str        # what to write instead

    def as_dict(self) -> dict[str, str]:
        return {"what": self.what, "why": self.why, "example": self.example, "fix": self.fix}


@dataclass(frozen=True)
class Hit:
    """What a check returns: where, and the message for this occurrence."""

    line: int
    col: int          # 1-based, in characters
    message: str


ID_SHAPE = re.compile(r"^[A-Z]{2,4}\d{3}$")
NAME_SHAPE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


@dataclass(frozen=True)
class LintRule:
    id: str
    name: str
    title: str
    severity: Severity
    kind: FileKind
    docs: RuleDocs
    prevents: tuple[str, ...]               # runtime catalog ids whose failures this rule prevents
    check: Callable[[Any], Iterable[Hit]] = field(compare=False, repr=False)
    helps_diagnose: tuple[str, ...] = ()    # runtime ids it does not prevent but makes diagnosable
    fixture: str = ""                       # file name under tests/lint_fixtures/
    references: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not ID_SHAPE.match(self.id):
            raise ValueError(f"lint rule id {self.id!r} must look like DDP101")
        if not NAME_SHAPE.match(self.name):
            raise ValueError(f"lint rule {self.id}: name {self.name!r} must be a lower-case slug")
        if not all(s.strip() for s in self.docs.as_dict().values()):
            raise ValueError(f"lint rule {self.id}: every docs field is required")

    def describe(self) -> dict[str, Any]:
        """Plain data for `triage explain` and the JSON/SARIF renderers; no printing."""
        return {
            "id": self.id,
            "name": self.name,
            "title": self.title,
            "severity": self.severity.value,
            "applies_to": self.kind.value,
            "prevents": list(self.prevents),
            "helps_diagnose": list(self.helps_diagnose),
            "docs": self.docs.as_dict(),
            "references": list(self.references),
            "fixture": self.fixture,
        }


@dataclass(frozen=True)
class Finding:
    rule_id: str
    rule_name: str
    severity: Severity
    path: str         # as given on the command line (relative stays relative)
    line: int
    col: int
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule_id, "name": self.rule_name, "severity": self.severity.value,
            "path": self.path, "line": self.line, "col": self.col, "message": self.message,
        }


@dataclass(frozen=True)
class Problem:
    """A file that could not be linted (syntax error, undecodable bytes); reported, not fatal."""

    path: str
    line: int
    message: str


@dataclass(frozen=True)
class LintResult:
    findings: tuple[Finding, ...]
    problems: tuple[Problem, ...]
    files_checked: int
    rules: tuple[LintRule, ...]      # the rules that were active

    def at_or_above(self, threshold: Severity) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity.weight >= threshold.weight)

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in Severity}
        for f in self.findings:
            out[f.severity.value] += 1
        return out
