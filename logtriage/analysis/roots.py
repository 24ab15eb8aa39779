"""The values the root-cause analysis hands around: verdicts, the chosen root, the causal chain,
what is known about the ranks, and the evidence order (timestamps where comparable, else input
order)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

from logtriage.analysis.findings import Finding
from logtriage.analysis.timestamps import clearly_before
from logtriage.catalog.rule import Rule


class Verdict(str, Enum):
    FAILED = "failed"
    HUNG = "hung"
    OK = "ok"


class ChainRole(str, Enum):
    INITIATING = "initiating"
    CASCADE = "cascade"
    TEARDOWN = "teardown"


@dataclass(frozen=True)
class RootCause:
    rule: Rule
    finding: Finding | None          # None when derived from facts (a hang, ranks' progress)
    rank: int | None
    ranks: tuple[int, ...]
    confidence: float
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class ChainLink:
    rule: Rule
    role: ChainRole
    ranks: tuple[int, ...]
    first: Finding
    count: int


@dataclass(frozen=True)
class RankFacts:
    """What the analysis knows about the ranks beyond findings."""
    known: frozenset[int]
    exit_codes: dict[int, int] = field(default_factory=dict)      # rank -> worker exit code
    completed: frozenset[int] = frozenset()                        # ranks that exited 0
    last_step: dict[int, int] = field(default_factory=dict)
    summary_root: int | None = None     # the rank torchelastic's "Root Cause (first observed failure)" names
    speaking: frozenset[int] = frozenset()   # ranks with lines of their own in the log
    # rank -> the input shape it passed, from a framework's list of every process's shape
    # (accelerate's `- Process 4: [16, 1]` under a shape-mismatch error)
    reported_shapes: dict[int, str] = field(default_factory=dict)
    # a rank stream -> (source, first line, last line, last text) of its progress lines (`step 5 loss ...`)
    last_progress: dict = field(default_factory=dict)
    # input source -> the line of its last progress line in any stream (a rank's, or one no rank claims)
    progress_end: dict[int, int] = field(default_factory=dict)


def read_as(root: RootCause, catalog, rule_id: str, reason: str) -> RootCause:
    """The root read as another rule of the catalog, with the reason why (unchanged where the catalog lacks it)."""
    rule = catalog.get(rule_id)
    return root if rule is None else replace(root, rule=rule, reasons=root.reasons + (reason,))


def ranks_of(findings) -> tuple[int, ...]:
    """The ranks the findings name, in order, each once."""
    return tuple(sorted({f.rank for f in findings if f.rank is not None}))


def earliest(findings: list[Finding]) -> Finding:
    best = findings[0]
    for candidate in findings[1:]:
        order = clearly_before(candidate.stamp, best.stamp)
        if order is True or (order is None and candidate.seq < best.seq and not _stamp_says_later(candidate, best)):
            best = candidate
    return best


def _stamp_says_later(a: Finding, b: Finding) -> bool:
    return clearly_before(b.stamp, a.stamp) is True
