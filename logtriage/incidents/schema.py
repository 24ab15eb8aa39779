"""The incident database's schema and its versioned migrations.

The schema version lives in `PRAGMA user_version`, the file's owner in `PRAGMA application_id`.
A migration is a list of statements run in one `BEGIN IMMEDIATE` transaction together with the new
`user_version`, so a process killed half-way leaves the old schema intact. Never edit a released
migration: append the next one.
"""

from __future__ import annotations

import sqlite3

from logtriage.errors import StoreError

APPLICATION_ID = 0x4C545249          # "LTRI"

MIGRATIONS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (1, (
        """CREATE TABLE incidents (
             id INTEGER PRIMARY KEY,
             title TEXT NOT NULL,
             rule_id TEXT NOT NULL,
             category TEXT NOT NULL,
             status TEXT NOT NULL CHECK (status IN ('open', 'resolved')),
             fingerprint_version INTEGER NOT NULL,
             fingerprint TEXT NOT NULL,
             basis TEXT NOT NULL,
             created_at TEXT NOT NULL,
             last_seen_at TEXT NOT NULL,
             occurrence_count INTEGER NOT NULL DEFAULT 0 CHECK (occurrence_count >= 0),
             resolved_at TEXT,
             resolution_note TEXT)""",
        # Every fingerprint version's key of an incident: lookups try the newest version first.
        """CREATE TABLE fingerprints (
             version INTEGER NOT NULL,
             hash TEXT NOT NULL,
             incident_id INTEGER NOT NULL REFERENCES incidents(id),
             PRIMARY KEY (version, hash)) WITHOUT ROWID""",
        """CREATE TABLE occurrences (
             id INTEGER PRIMARY KEY,
             incident_id INTEGER NOT NULL REFERENCES incidents(id),
             added_at TEXT NOT NULL,
             run_id TEXT,
             title TEXT,
             verdict TEXT NOT NULL,
             rule_id TEXT NOT NULL,
             category TEXT NOT NULL,
             rank INTEGER,
             ranks TEXT NOT NULL,
             root_text TEXT NOT NULL,
             sources TEXT NOT NULL,
             fingerprint_version INTEGER NOT NULL,
             fingerprint TEXT NOT NULL,
             redacted INTEGER NOT NULL CHECK (redacted IN (0, 1)),
             redact_extra TEXT NOT NULL,
             evidence TEXT NOT NULL,
             report_json TEXT NOT NULL,
             report_md TEXT NOT NULL)""",
        "CREATE INDEX occurrences_by_incident ON occurrences (incident_id, added_at)",
        "CREATE INDEX occurrences_by_time ON occurrences (added_at)",
        """CREATE TABLE tags (
             occurrence_id INTEGER NOT NULL REFERENCES occurrences(id),
             incident_id INTEGER NOT NULL REFERENCES incidents(id),
             key TEXT NOT NULL,
             value TEXT NOT NULL,
             PRIMARY KEY (occurrence_id, key, value))""",
        "CREATE INDEX tags_by_value ON tags (key, value, incident_id)",
        """CREATE TABLE links (
             occurrence_id INTEGER NOT NULL REFERENCES occurrences(id),
             url TEXT NOT NULL)""",
        """CREATE TABLE events (
             id INTEGER PRIMARY KEY,
             incident_id INTEGER NOT NULL REFERENCES incidents(id),
             at TEXT NOT NULL,
             kind TEXT NOT NULL CHECK (kind IN ('created', 'resolved', 'reopened', 'regressed')),
             note TEXT,
             occurrence_id INTEGER REFERENCES occurrences(id))""",
        "CREATE INDEX events_by_incident ON events (incident_id, id)",
    )),
)
LATEST_VERSION = MIGRATIONS[-1][0]


def schema_version(conn: sqlite3.Connection) -> int:
    return conn.execute("PRAGMA user_version").fetchone()[0]


def check_owner(conn: sqlite3.Connection, path: str) -> int:
    """The file's schema version, after making sure it is ours and not from a newer logtriage."""
    owner = conn.execute("PRAGMA application_id").fetchone()[0]
    version = schema_version(conn)
    if owner not in (0, APPLICATION_ID):
        raise StoreError(f"{path} is an SQLite database of another application (application_id {owner:#x})")
    if owner == 0 and version == 0:
        tables = conn.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0]
        if tables:
            raise StoreError(f"{path} is an SQLite database with other tables, not an incident store")
    if version > LATEST_VERSION:
        raise StoreError(f"{path} has incident schema version {version}, newer than this logtriage knows "
                         f"({LATEST_VERSION}); upgrade logtriage, or point --db / LOGTRIAGE_DB elsewhere")
    return version


def migrate(conn: sqlite3.Connection, path: str) -> int:
    """Bring the schema to LATEST_VERSION inside the caller's write transaction; returns the old version."""
    version = check_owner(conn, path)
    for target, statements in MIGRATIONS:
        if target <= version:
            continue
        for statement in statements:
            conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {int(target)}")
    if version < LATEST_VERSION:
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    return version
