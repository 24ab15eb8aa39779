"""Plain-text views of the store for the terminal: the incident list and one incident's record."""

from __future__ import annotations

from datetime import datetime
from typing import Sequence

from logtriage.incidents.models import Incident, IncidentRecord, Status
from logtriage.report.safe import terminal_safe

SHOWN_OCCURRENCES = 20


def _when(moment: datetime | None) -> str:
    return moment.strftime("%Y-%m-%d %H:%M") if moment else ""


def _short(title: str, width: int = 72) -> str:
    return title if len(title) <= width else title[:width - 1] + "…"


def incident_table(incidents: Sequence[Incident]) -> str:
    if not incidents:
        return "no incidents\n"
    rows = [("ID", "STATUS", "SEEN", "LAST SEEN (UTC)", "CATEGORY", "RULE", "TITLE")]
    rows += [(str(i.id), i.status.value, str(i.occurrence_count), _when(i.last_seen_at), i.category, i.rule_id,
              terminal_safe(_short(i.title))) for i in incidents]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        cells = [cell.rjust(w) if c in (0, 2) else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells + [row[-1]]).rstrip())
    return "\n".join(lines) + "\n"


def record_text(record: IncidentRecord) -> str:
    inc = record.incident
    out = [f"incident {inc.id} · {inc.status.value} · {inc.category} · {inc.rule_id}",
           f"  title        {terminal_safe(inc.title)}",
           f"  fingerprint  {inc.fingerprint}",
           f"  grouped by   {terminal_safe(inc.basis)}",
           f"  seen         {inc.occurrence_count} time(s), first {_when(inc.created_at)}, last {_when(inc.last_seen_at)} UTC"]
    if inc.status is Status.RESOLVED:
        out.append(f"  resolved     {_when(inc.resolved_at)} {terminal_safe(inc.resolution_note or '')}".rstrip())
    out += ["", "history:"]
    for event in record.events:
        note = f"  {terminal_safe(event.note)}" if event.note else ""
        occ = f" (occurrence {event.occurrence_id})" if event.occurrence_id else ""
        out.append(f"  {_when(event.at)}  {event.kind.value}{occ}{note}")
    out += ["", f"occurrences (newest first{', last ' + str(SHOWN_OCCURRENCES) if len(record.occurrences) > SHOWN_OCCURRENCES else ''}):"]
    for occ in record.occurrences[:SHOWN_OCCURRENCES]:
        ranks = ",".join(map(str, occ.ranks)) or "-"
        redaction = ("redacted" + (f"+{'+'.join(occ.redact_extra)}" if occ.redact_extra else "")) if occ.redacted \
            else "NOT redacted"
        out.append(f"  #{occ.id:<5} {_when(occ.added_at)}  {terminal_safe(occ.label):<22} rank {ranks:<6} {redaction}")
        out.append(f"          sources: {terminal_safe(', '.join(occ.sources))}")
        if occ.tags:
            out.append(f"          tags: {terminal_safe(', '.join(f'{k}={v}' for k, v in occ.tags))}")
        for url in occ.links:
            out.append(f"          link: {terminal_safe(url)}")
    if record.occurrences:
        latest = record.occurrences[0]
        out += ["", f"evidence (occurrence {latest.id}):"]
        out += [f"  {terminal_safe(line)}" for line in latest.evidence.splitlines()]
    return "\n".join(out) + "\n"
