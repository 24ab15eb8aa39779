"""Reads of the incident database: rows to values. Writers live in store.py."""

from __future__ import annotations

import json
import sqlite3
from datetime import datetime, timezone

from logtriage.incidents.models import (Event, EventKind, Incident, IncidentFilter, IncidentRecord, Occurrence,
                                        Status)

_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"      # fixed width: text order is time order


def time_text(moment: datetime) -> str:
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc).replace(tzinfo=None)
    return moment.strftime(_TIME_FORMAT)


def parse_time(text: str | None) -> datetime | None:
    if text is None:
        return None
    return datetime.strptime(text, _TIME_FORMAT).replace(tzinfo=timezone.utc)


_INCIDENT_COLUMNS = ("id, title, rule_id, category, status, fingerprint_version, fingerprint, basis, created_at, "
                     "last_seen_at, occurrence_count, resolved_at, resolution_note")
_OCCURRENCE_COLUMNS = ("id, incident_id, added_at, run_id, title, verdict, rule_id, category, rank, ranks, root_text, "
                       "sources, fingerprint_version, fingerprint, redacted, redact_extra, evidence")


def _incident(row: tuple) -> Incident:
    (id_, title, rule_id, category, status, fp_version, fp, basis, created, last_seen, count, resolved_at,
     note) = row
    return Incident(id_, title, rule_id, category, Status(status), f"v{fp_version}:{fp}", basis, parse_time(created),
                    parse_time(last_seen), count, parse_time(resolved_at), note)


def _occurrence(conn: sqlite3.Connection, row: tuple) -> Occurrence:
    (id_, incident_id, added, run_id, title, verdict, rule_id, category, rank, ranks, root_text, sources,
     fp_version, fp, redacted, extra, evidence) = row
    tags = tuple(conn.execute("SELECT key, value FROM tags WHERE occurrence_id = ? ORDER BY key, value", (id_,)))
    links = tuple(u for (u,) in conn.execute("SELECT url FROM links WHERE occurrence_id = ? ORDER BY rowid", (id_,)))
    return Occurrence(id_, incident_id, parse_time(added), run_id, title, verdict, rule_id, category, rank,
                      tuple(json.loads(ranks)), root_text, tuple(json.loads(sources)), f"v{fp_version}:{fp}",
                      bool(redacted), tuple(json.loads(extra)), evidence, tags, links)


def get_incident(conn: sqlite3.Connection, incident_id: int) -> Incident | None:
    row = conn.execute(f"SELECT {_INCIDENT_COLUMNS} FROM incidents WHERE id = ?", (incident_id,)).fetchone()
    return _incident(row) if row else None


def find_incident(conn: sqlite3.Connection, version: int, digest: str) -> int | None:
    row = conn.execute("SELECT incident_id FROM fingerprints WHERE version = ? AND hash = ?",
                       (version, digest)).fetchone()
    return row[0] if row else None


def occurrences(conn: sqlite3.Connection, incident_id: int, limit: int | None = None,
                before_id: int | None = None) -> tuple[Occurrence, ...]:
    sql = f"SELECT {_OCCURRENCE_COLUMNS} FROM occurrences WHERE incident_id = ?"
    params: list = [incident_id]
    if before_id is not None:
        sql += " AND id < ?"
        params.append(before_id)
    sql += " ORDER BY added_at DESC, id DESC"
    if limit is not None:
        sql += " LIMIT ?"
        params.append(limit)
    return tuple(_occurrence(conn, row) for row in conn.execute(sql, params).fetchall())


def events(conn: sqlite3.Connection, incident_id: int) -> tuple[Event, ...]:
    rows = conn.execute("SELECT at, kind, note, occurrence_id FROM events WHERE incident_id = ? ORDER BY id",
                        (incident_id,)).fetchall()
    return tuple(Event(parse_time(at), EventKind(kind), note, occ) for at, kind, note, occ in rows)


def last_event(conn: sqlite3.Connection, incident_id: int, kind: EventKind) -> Event | None:
    row = conn.execute("SELECT at, kind, note, occurrence_id FROM events WHERE incident_id = ? AND kind = ? "
                       "ORDER BY id DESC LIMIT 1", (incident_id, kind.value)).fetchone()
    return Event(parse_time(row[0]), EventKind(row[1]), row[2], row[3]) if row else None


def list_incidents(conn: sqlite3.Connection, flt: IncidentFilter) -> tuple[Incident, ...]:
    where, params = [], []
    if flt.category:
        where.append("category = ?")
        params.append(flt.category)
    if flt.rule:
        where.append("rule_id = ?")
        params.append(flt.rule)
    if flt.status is not None:
        where.append("status = ?")
        params.append(flt.status.value)
    if flt.since is not None:
        where.append("last_seen_at >= ?")
        params.append(time_text(flt.since))
    for key, value in flt.tags:
        where.append("id IN (SELECT incident_id FROM tags WHERE key = ? AND value = ?)")
        params += [key, value]
    sql = f"SELECT {_INCIDENT_COLUMNS} FROM incidents"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY last_seen_at DESC, id DESC"
    if flt.limit is not None:
        sql += " LIMIT ?"
        params.append(flt.limit)
    return tuple(_incident(row) for row in conn.execute(sql, params).fetchall())


def record(conn: sqlite3.Connection, incident_id: int, with_reports: bool) -> IncidentRecord | None:
    incident = get_incident(conn, incident_id)
    if incident is None:
        return None
    json_reports: dict[int, str] = {}
    md_reports: dict[int, str] = {}
    if with_reports:
        for occ_id, report_json, report_md in conn.execute(
                "SELECT id, report_json, report_md FROM occurrences WHERE incident_id = ?", (incident_id,)):
            json_reports[occ_id] = report_json
            md_reports[occ_id] = report_md
    return IncidentRecord(incident, occurrences(conn, incident_id), events(conn, incident_id), json_reports,
                          md_reports)


def occurrence_rows(conn: sqlite3.Connection, since: datetime | None = None) -> list[tuple]:
    """(added_at, incident_id, rule_id, category, incident status) of every occurrence, for stats."""
    sql = ("SELECT o.added_at, o.incident_id, o.rule_id, o.category, i.status FROM occurrences o "
           "JOIN incidents i ON i.id = o.incident_id")
    params: tuple = ()
    if since is not None:
        sql += " WHERE o.added_at >= ?"
        params = (time_text(since),)
    return [(parse_time(a), i, r, c, s) for a, i, r, c, s in conn.execute(sql + " ORDER BY o.added_at", params)]


def consistency_problems(conn: sqlite3.Connection) -> list[str]:
    """SQLite's own integrity check plus the store's invariants (counts match rows, no orphans)."""
    problems = [row[0] for row in conn.execute("PRAGMA integrity_check") if row[0] != "ok"]
    problems += [f"foreign key: {row}" for row in conn.execute("PRAGMA foreign_key_check")]
    for incident_id, stored, actual in conn.execute(
            "SELECT i.id, i.occurrence_count, (SELECT count(*) FROM occurrences o WHERE o.incident_id = i.id) "
            "FROM incidents i"):
        if stored != actual:
            problems.append(f"incident {incident_id}: occurrence_count {stored} but {actual} occurrences")
        if actual == 0:
            problems.append(f"incident {incident_id} has no occurrence")
    orphans = conn.execute("SELECT count(*) FROM incidents i WHERE NOT EXISTS "
                           "(SELECT 1 FROM fingerprints f WHERE f.incident_id = i.id)").fetchone()[0]
    if orphans:
        problems.append(f"{orphans} incident(s) without a fingerprint")
    return problems
