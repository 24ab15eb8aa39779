"""Values of the incident store: what is recorded, what a query returns, what an `add` did."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum


class Status(str, Enum):
    OPEN = "open"
    RESOLVED = "resolved"


class AddOutcome(str, Enum):
    NEW = "new"                # first occurrence: a new incident
    REPEAT = "repeat"          # another occurrence of an open incident
    REGRESSION = "regression"  # an occurrence of a resolved incident, which is reopened


class EventKind(str, Enum):
    CREATED = "created"
    RESOLVED = "resolved"
    REOPENED = "reopened"
    REGRESSED = "regressed"


@dataclass(frozen=True)
class Fingerprint:
    """A grouping key: the algorithm version is part of it, so versions never collide."""
    version: int
    hash: str
    basis: str          # the masked text that was hashed, for people to read

    @property
    def key(self) -> str:
        return f"v{self.version}:{self.hash}"


@dataclass(frozen=True)
class OccurrenceDraft:
    """One triaged run, ready to store: every string already redacted (unless `redacted` is False)."""
    fingerprints: tuple[Fingerprint, ...]    # the current algorithm's first, then older ones
    rule_id: str
    category: str
    verdict: str
    rank: int | None
    ranks: tuple[int, ...]
    root_text: str
    default_title: str
    evidence: str
    report_json: str
    report_md: str
    sources: tuple[str, ...]
    redacted: bool
    redact_extra: tuple[str, ...] = ()
    title: str | None = None
    run_id: str | None = None
    tags: tuple[tuple[str, str], ...] = ()
    links: tuple[str, ...] = ()

    @property
    def fingerprint(self) -> Fingerprint:
        return self.fingerprints[0]


@dataclass(frozen=True)
class Incident:
    id: int
    title: str
    rule_id: str
    category: str
    status: Status
    fingerprint: str        # "v<version>:<hash>" of the occurrence that created it
    basis: str
    created_at: datetime
    last_seen_at: datetime
    occurrence_count: int
    resolved_at: datetime | None = None
    resolution_note: str | None = None


@dataclass(frozen=True)
class Occurrence:
    id: int
    incident_id: int
    added_at: datetime
    run_id: str | None
    title: str | None
    verdict: str
    rule_id: str
    category: str
    rank: int | None
    ranks: tuple[int, ...]
    root_text: str
    sources: tuple[str, ...]
    fingerprint: str
    redacted: bool
    redact_extra: tuple[str, ...]
    evidence: str
    tags: tuple[tuple[str, str], ...] = ()
    links: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"run {self.run_id}" if self.run_id else f"occurrence {self.id}"


@dataclass(frozen=True)
class Event:
    at: datetime
    kind: EventKind
    note: str | None = None
    occurrence_id: int | None = None


@dataclass(frozen=True)
class AddResult:
    incident: Incident
    occurrence_id: int
    outcome: AddOutcome
    previous: tuple[Occurrence, ...] = ()      # earlier occurrences, newest first (at most a few)
    last_resolution: Event | None = None       # the resolve event a regression reopened


@dataclass(frozen=True)
class IncidentFilter:
    category: str | None = None
    rule: str | None = None
    tags: tuple[tuple[str, str], ...] = ()
    status: Status | None = None
    since: datetime | None = None              # last seen at or after
    limit: int | None = None


@dataclass(frozen=True)
class IncidentRecord:
    """Everything stored about one incident (for `show` and `export`)."""
    incident: Incident
    occurrences: tuple[Occurrence, ...]        # newest first
    events: tuple[Event, ...]                  # oldest first
    reports_json: dict[int, str] = field(default_factory=dict)   # occurrence id -> report JSON
    reports_md: dict[int, str] = field(default_factory=dict)
