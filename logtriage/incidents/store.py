"""The incident store: one SQLite file, safe for many processes at once.

    with IncidentStore.open("incidents.db") as store:
        result = store.add(draft)            # -> AddResult (new | repeat | regression)
        store.resolve(result.incident.id, "raised NCCL timeout")

Writes run in `BEGIN IMMEDIATE` transactions (one writer at a time, decided up front, so no
deadlock between two readers turning writers), the journal is a WAL with `synchronous=FULL`,
and a busy database is retried with backoff until `timeout_s`. A process killed mid-write leaves
the last committed state: SQLite rolls the open transaction back on the next open.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, TypeVar

from logtriage.errors import StoreError, UsageError
from logtriage.incidents import queries, schema
from logtriage.incidents.models import (AddOutcome, AddResult, EventKind, Incident, IncidentFilter, IncidentRecord,
                                        OccurrenceDraft, Status)

DB_ENV = "LOGTRIAGE_DB"
DB_FILE = "incidents.db"
BUSY_TIMEOUT_MS = 2000             # SQLite's own wait inside one attempt
# Test hook: a process with this variable set to "add" SIGKILLs itself inside the add transaction,
# after the occurrence row is written and before the commit (tests/test_incidents_concurrency.py).
CRASH_ENV = "LOGTRIAGE_TEST_CRASH_IN"
PREVIOUS_SHOWN = 5

T = TypeVar("T")


def default_db_path() -> Path:
    """$LOGTRIAGE_DB, else incidents.db in the user's data directory."""
    if os.environ.get(DB_ENV):
        return Path(os.environ[DB_ENV]).expanduser()
    import platformdirs
    return Path(platformdirs.user_data_dir("logtriage")) / DB_FILE


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


class IncidentStore:
    def __init__(self, conn: sqlite3.Connection, path: str, now: Callable[[], datetime] = _utcnow,
                 timeout_s: float = 60.0):
        self._conn = conn
        self.path = path
        self._now = now
        self.timeout_s = timeout_s

    @classmethod
    def open(cls, path: str | os.PathLike | None = None, now: Callable[[], datetime] = _utcnow,
             timeout_s: float = 60.0) -> "IncidentStore":
        db = Path(path) if path is not None else default_db_path()
        try:
            db.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(str(db), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open incident store {db}: {exc}") from exc
        store = cls(conn, str(db), now, timeout_s)
        try:
            store._retry(store._prepare)
        except BaseException:
            conn.close()
            raise
        return store

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> "IncidentStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- writes ---------------------------------------------------------------------------

    def add(self, draft: OccurrenceDraft) -> AddResult:
        return self._write(lambda conn: self._add(conn, draft))

    def resolve(self, incident_id: int, note: str | None) -> Incident:
        def change(conn: sqlite3.Connection) -> Incident:
            incident = self._existing(conn, incident_id)
            if incident.status is Status.RESOLVED:
                raise UsageError(f"incident {incident_id} is already resolved (reopen it first)")
            now = queries.time_text(self._now())
            conn.execute("UPDATE incidents SET status = 'resolved', resolved_at = ?, resolution_note = ? "
                         "WHERE id = ?", (now, note, incident_id))
            conn.execute("INSERT INTO events (incident_id, at, kind, note) VALUES (?, ?, 'resolved', ?)",
                         (incident_id, now, note))
            return queries.get_incident(conn, incident_id)
        return self._write(change)

    def reopen(self, incident_id: int, note: str | None = None) -> Incident:
        def change(conn: sqlite3.Connection) -> Incident:
            incident = self._existing(conn, incident_id)
            if incident.status is Status.OPEN:
                raise UsageError(f"incident {incident_id} is already open")
            conn.execute("UPDATE incidents SET status = 'open', resolved_at = NULL WHERE id = ?", (incident_id,))
            conn.execute("INSERT INTO events (incident_id, at, kind, note) VALUES (?, ?, 'reopened', ?)",
                         (incident_id, queries.time_text(self._now()), note))
            return queries.get_incident(conn, incident_id)
        return self._write(change)

    # --- reads ----------------------------------------------------------------------------

    def get(self, incident_id: int, with_reports: bool = False) -> IncidentRecord:
        found = self._read(lambda conn: queries.record(conn, incident_id, with_reports))
        if found is None:
            raise UsageError(f"no incident {incident_id} in {self.path}")
        return found

    def list(self, flt: IncidentFilter = IncidentFilter()) -> tuple[Incident, ...]:
        return self._read(lambda conn: queries.list_incidents(conn, flt))

    def occurrence_rows(self, since: datetime | None = None) -> list[tuple]:
        return self._read(lambda conn: queries.occurrence_rows(conn, since))

    def problems(self) -> list[str]:
        return self._read(queries.consistency_problems)

    # --- machinery ------------------------------------------------------------------------

    def _prepare(self) -> None:
        conn = self._conn
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("PRAGMA synchronous = FULL")
        # one read transaction: owner, version and tables from the same snapshot (another process
        # may be creating the schema between three autocommit reads)
        version = self._transaction(lambda c: schema.check_owner(c, self.path), "DEFERRED")
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        if mode.lower() != "wal":
            conn.execute("PRAGMA journal_mode = WAL")
        if version < schema.LATEST_VERSION:
            self._transaction(lambda c: schema.migrate(c, self.path))

    def _add(self, conn: sqlite3.Connection, draft: OccurrenceDraft) -> AddResult:
        now = queries.time_text(self._now())
        incident_id = None
        for fp in draft.fingerprints:
            incident_id = queries.find_incident(conn, fp.version, fp.hash)
            if incident_id is not None:
                break
        current = draft.fingerprint
        if incident_id is None:
            outcome = AddOutcome.NEW
            incident_id = conn.execute(
                "INSERT INTO incidents (title, rule_id, category, status, fingerprint_version, fingerprint, basis, "
                "created_at, last_seen_at) VALUES (?, ?, ?, 'open', ?, ?, ?, ?, ?)",
                (draft.title or draft.default_title, draft.rule_id, draft.category, current.version, current.hash,
                 current.basis, now, now)).lastrowid
        else:
            incident = queries.get_incident(conn, incident_id)
            outcome = AddOutcome.REGRESSION if incident.status is Status.RESOLVED else AddOutcome.REPEAT
        # Every version's key points at the incident, so older and newer logtriage versions agree.
        conn.executemany("INSERT OR IGNORE INTO fingerprints (version, hash, incident_id) VALUES (?, ?, ?)",
                         [(fp.version, fp.hash, incident_id) for fp in draft.fingerprints])
        occurrence_id = conn.execute(
            "INSERT INTO occurrences (incident_id, added_at, run_id, title, verdict, rule_id, category, rank, ranks, "
            "root_text, sources, fingerprint_version, fingerprint, redacted, redact_extra, evidence, report_json, "
            "report_md) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (incident_id, now, draft.run_id, draft.title, draft.verdict, draft.rule_id, draft.category, draft.rank,
             json.dumps(list(draft.ranks)), draft.root_text, json.dumps(list(draft.sources)), current.version,
             current.hash, int(draft.redacted), json.dumps(list(draft.redact_extra)), draft.evidence,
             draft.report_json, draft.report_md)).lastrowid
        conn.executemany("INSERT OR IGNORE INTO tags (occurrence_id, incident_id, key, value) VALUES (?, ?, ?, ?)",
                         [(occurrence_id, incident_id, k, v) for k, v in draft.tags])
        conn.executemany("INSERT INTO links (occurrence_id, url) VALUES (?, ?)",
                         [(occurrence_id, url) for url in draft.links])
        if os.environ.get(CRASH_ENV) == "add":
            os.kill(os.getpid(), signal.SIGKILL)
        conn.execute("UPDATE incidents SET occurrence_count = occurrence_count + 1, last_seen_at = ? WHERE id = ?",
                     (now, incident_id))
        last_resolution = None
        if outcome is AddOutcome.NEW:
            conn.execute("INSERT INTO events (incident_id, at, kind, occurrence_id) VALUES (?, ?, 'created', ?)",
                         (incident_id, now, occurrence_id))
        elif outcome is AddOutcome.REGRESSION:
            last_resolution = queries.last_event(conn, incident_id, EventKind.RESOLVED)
            conn.execute("UPDATE incidents SET status = 'open', resolved_at = NULL WHERE id = ?", (incident_id,))
            conn.execute("INSERT INTO events (incident_id, at, kind, note, occurrence_id) "
                         "VALUES (?, ?, 'regressed', ?, ?)", (incident_id, now, "seen again after resolve",
                                                              occurrence_id))
        previous = queries.occurrences(conn, incident_id, PREVIOUS_SHOWN, before_id=occurrence_id)
        return AddResult(queries.get_incident(conn, incident_id), occurrence_id, outcome, previous, last_resolution)

    def _existing(self, conn: sqlite3.Connection, incident_id: int) -> Incident:
        incident = queries.get_incident(conn, incident_id)
        if incident is None:
            raise UsageError(f"no incident {incident_id} in {self.path}")
        return incident

    def _transaction(self, work: Callable[[sqlite3.Connection], T], mode: str = "IMMEDIATE") -> T:
        conn = self._conn
        conn.execute(f"BEGIN {mode}")
        try:
            result = work(conn)
            conn.execute("COMMIT")
            return result
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _write(self, work: Callable[[sqlite3.Connection], T]) -> T:
        return self._retry(lambda: self._transaction(work, "IMMEDIATE"))

    def _read(self, work: Callable[[sqlite3.Connection], T]) -> T:
        return self._retry(lambda: self._transaction(work, "DEFERRED"))

    def _retry(self, attempt: Callable[[], T]) -> T:
        """Run `attempt`, again after a jittered backoff while the database is busy."""
        deadline = time.monotonic() + self.timeout_s
        delay = 0.005
        while True:
            try:
                return attempt()
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise StoreError(f"incident store {self.path}: {exc}") from exc
                if time.monotonic() >= deadline:
                    raise StoreError(f"incident store {self.path} stayed busy for {self.timeout_s:.0f}s: {exc}") \
                        from exc
            except sqlite3.DatabaseError as exc:
                raise StoreError(f"incident store {self.path}: {exc}") from exc
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 0.25)
