"""The report: one model, rendered as text, Markdown or JSON (docs/json-contract.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class EvidenceLine:
    source: str
    line: int
    text: str
    is_match: bool = False


@dataclass(frozen=True)
class RootCauseView:
    rule_id: str
    category: str
    title: str
    rank: int | None
    ranks: tuple[int, ...]
    line: int | None
    source: str | None
    text: str
    exception_type: str | None
    confidence: float
    layer: str | None
    explanation: str
    fix: str
    misdiagnosis: str
    reasons: tuple[str, ...]
    evidence: tuple[EvidenceLine, ...]
    stream: str | None


@dataclass(frozen=True)
class ChainEntry:
    rule_id: str
    category: str
    title: str
    role: str              # initiating | cascade | teardown
    ranks: tuple[int, ...]
    line: int
    source: str
    text: str
    count: int


@dataclass(frozen=True)
class RankRow:
    rank: int
    attempt: int
    host: str
    lines: int
    status: str            # ok | failed | hung | killed | unknown
    role: str              # root | cascade | teardown | none
    first_error_line: int | None
    first_error_source: str | None
    first_error: str | None
    last_step: int | None
    last_step_line: int | None


@dataclass(frozen=True)
class StreamRow:
    stream: str
    kind: str
    rank: int | None
    attempt: int
    lines: int


@dataclass(frozen=True)
class FindingView:
    rule_id: str
    category: str
    role: str
    rank: int | None
    line: int
    source: str
    text: str
    captures: Mapping[str, str]
    stream: str
    count: int


@dataclass(frozen=True)
class Report:
    verdict: str
    root_cause: RootCauseView | None
    chain: tuple[ChainEntry, ...]
    ranks: tuple[RankRow, ...]
    findings: tuple[FindingView, ...]
    environment: Mapping[str, Any]
    input_lines: int
    unattributed_lines: int
    streams: tuple[StreamRow, ...]
    sources: tuple[str, ...]
    notes: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    redaction: Mapping[str, Any] = field(default_factory=dict)
    recovered: RootCauseView | None = None    # an earlier attempt's failure torchrun restarted from

    def to_dict(self) -> dict[str, Any]:
        rc = self.root_cause
        return {
            "schema_version": SCHEMA_VERSION,
            "verdict": self.verdict,
            "root_cause": _root_dict(rc),
            "chain": [{"rule_id": c.rule_id, "category": c.category, "title": c.title, "role": c.role,
                       "ranks": list(c.ranks), "line": c.line, "source": c.source, "text": c.text,
                       "count": c.count} for c in self.chain],
            "ranks": [{"rank": r.rank, "attempt": r.attempt, "host": r.host or None, "lines": r.lines,
                       "status": r.status, "role": r.role, "first_error_line": r.first_error_line,
                       "first_error_source": r.first_error_source, "first_error": r.first_error,
                       "last_step": r.last_step, "last_step_line": r.last_step_line} for r in self.ranks],
            "findings": [{"rule_id": f.rule_id, "category": f.category, "role": f.role, "rank": f.rank,
                          "line": f.line, "source": f.source, "text": f.text, "captures": dict(f.captures),
                          "stream": f.stream, "count": f.count} for f in self.findings],
            "environment": dict(self.environment),
            "input_lines": self.input_lines,
            "unattributed_lines": self.unattributed_lines,
            "streams": [{"stream": s.stream, "kind": s.kind, "rank": s.rank, "attempt": s.attempt,
                         "lines": s.lines} for s in self.streams],
            "sources": list(self.sources),
            "notes": list(self.notes),
            "problems": list(self.problems),
            "redaction": dict(self.redaction),
            "recovered": _root_dict(self.recovered),
        }


def _root_dict(rc: RootCauseView | None) -> dict[str, Any] | None:
    return None if rc is None else {
        "rule_id": rc.rule_id, "category": rc.category, "title": rc.title, "rank": rc.rank,
        "ranks": list(rc.ranks), "line": rc.line, "source": rc.source, "text": rc.text,
        "exception_type": rc.exception_type, "confidence": round(rc.confidence, 2),
        "layer": rc.layer, "stream": rc.stream, "reasons": list(rc.reasons),
        "explanation": rc.explanation, "fix": rc.fix, "misdiagnosis": rc.misdiagnosis,
        "evidence": [{"source": e.source, "line": e.line, "text": e.text, "match": e.is_match}
                     for e in rc.evidence],
    }
