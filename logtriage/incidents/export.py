"""A whole incident record (every occurrence, its report, the resolve history) as JSON or Markdown."""

from __future__ import annotations

import re
from typing import Any

import orjson

from logtriage.errors import UsageError
from logtriage.incidents.models import Event, Incident, IncidentRecord, Occurrence, Status
from logtriage.report.safe import markdown_code_block, markdown_inline as md

EXPORT_SCHEMA_VERSION = 1
FORMATS = ("md", "json")


def export(record: IncidentRecord, fmt: str) -> str:
    if fmt == "json":
        return orjson.dumps(record_dict(record), option=orjson.OPT_INDENT_2).decode() + "\n"
    if fmt == "md":
        return record_markdown(record)
    raise UsageError(f"unknown export format '{fmt}' (choose from {', '.join(FORMATS)})")


def _time(moment) -> str | None:
    return moment.isoformat().replace("+00:00", "Z") if moment else None


def incident_dict(incident: Incident) -> dict[str, Any]:
    return {"id": incident.id, "title": incident.title, "status": incident.status.value,
            "rule_id": incident.rule_id, "category": incident.category, "fingerprint": incident.fingerprint,
            "fingerprint_basis": incident.basis, "created_at": _time(incident.created_at),
            "last_seen_at": _time(incident.last_seen_at), "occurrence_count": incident.occurrence_count,
            "resolved_at": _time(incident.resolved_at), "resolution_note": incident.resolution_note}


def _event_dict(event: Event) -> dict[str, Any]:
    return {"at": _time(event.at), "kind": event.kind.value, "note": event.note, "occurrence_id": event.occurrence_id}


def _occurrence_dict(occ: Occurrence, report_json: str | None) -> dict[str, Any]:
    return {"id": occ.id, "added_at": _time(occ.added_at), "run_id": occ.run_id, "title": occ.title,
            "verdict": occ.verdict, "rule_id": occ.rule_id, "category": occ.category, "rank": occ.rank,
            "ranks": list(occ.ranks), "root_text": occ.root_text, "sources": list(occ.sources),
            "fingerprint": occ.fingerprint, "redacted": occ.redacted, "redact_extra": list(occ.redact_extra),
            "tags": [{"key": k, "value": v} for k, v in occ.tags], "links": list(occ.links),
            "evidence": occ.evidence, "report": orjson.loads(report_json) if report_json else None}


def record_dict(record: IncidentRecord) -> dict[str, Any]:
    return {"schema_version": EXPORT_SCHEMA_VERSION, "incident": incident_dict(record.incident),
            "events": [_event_dict(e) for e in record.events],
            "occurrences": [_occurrence_dict(o, record.reports_json.get(o.id)) for o in record.occurrences]}


def record_markdown(record: IncidentRecord) -> str:
    inc = record.incident
    out = [f"# Incident {inc.id}: {md(inc.title)}", "", "| | |", "|---|---|",
           f"| status | {inc.status.value} |", f"| rule | `{md(inc.rule_id)}` |", f"| category | {md(inc.category)} |",
           f"| occurrences | {inc.occurrence_count} |", f"| first seen | {_time(inc.created_at)} |",
           f"| last seen | {_time(inc.last_seen_at)} |", f"| fingerprint | `{md(inc.fingerprint)}` |",
           f"| grouped by | {md(inc.basis)} |"]
    if inc.resolution_note:
        label = "resolution" if inc.status is Status.RESOLVED else "last resolution"
        out.append(f"| {label} | {md(inc.resolution_note)} |")
    out += ["", "## History", ""]
    out += [f"- {_time(e.at)} **{e.kind.value}**" + (f": {md(e.note)}" if e.note else "") for e in record.events]
    out += ["", "## Occurrences", "", "| # | added | run | rank(s) | sources | redacted | tags |",
            "|---|---|---|---|---|---|---|"]
    for occ in record.occurrences:
        ranks = ", ".join(map(str, occ.ranks)) or "—"
        tags = ", ".join(f"{k}={v}" for k, v in occ.tags)
        redacted = ("yes" + (f" (+{', '.join(occ.redact_extra)})" if occ.redact_extra else "")) if occ.redacted else "no"
        out.append(f"| {occ.id} | {_time(occ.added_at)} | {md(occ.run_id or '')} | {ranks} | "
                   f"{md(', '.join(occ.sources))} | {redacted} | {md(tags)} |")
    for occ in record.occurrences:
        out += ["", f"## Occurrence {occ.id} ({md(occ.label)}, {_time(occ.added_at)})", ""]
        if occ.links:
            out += [f"- link: {md(url)}" for url in occ.links] + [""]
        report = record.reports_md.get(occ.id)
        if report:
            out.append(_demote(report).rstrip("\n"))
        else:
            out.append(markdown_code_block(occ.evidence.splitlines()))
    return "\n".join(out) + "\n"


def _demote(markdown: str) -> str:
    """Headings of an embedded report two levels down, so they nest under the occurrence."""
    return re.sub(r"(?m)^(#{1,4}) ", lambda m: "#" * (len(m.group(1)) + 2) + " ", markdown)
