"""The store's lifecycle, schema guard, queries, export and stats; the `triage incident` CLI."""

from __future__ import annotations

import json
import sqlite3
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pandas as pd
import pytest

from logtriage.cli import main
from logtriage.errors import StoreError, UsageError
from logtriage.incidents import AddOutcome, EventKind, IncidentFilter, IncidentStore, Status, record_logs
from logtriage.incidents import schema
from logtriage.incidents.export import export
from logtriage.incidents.stats import occurrence_stats, write_table

ROOT = Path(__file__).resolve().parents[1]
CPU = ROOT / "sample_logs" / "cpu"
KEYERROR = str(CPU / "rank_exception__np4.log")
SIGKILL = str(CPU / "rank_sigkill__np2.log")
TIMEOUT = str(CPU / "skip_collective__np2.log")


class Clock:
    def __init__(self, start: datetime):
        self.now = start

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture(scope="module")
def drafts():
    return {"keyerror": record_logs([KEYERROR], run_id="r1", tags=[("cluster", "a")]),
            "keyerror2": record_logs([KEYERROR], run_id="r2", tags=[("cluster", "b")], links=["https://t/1"]),
            "sigkill": record_logs([SIGKILL], run_id="r3", tags=[("cluster", "a")]),
            "timeout": record_logs([TIMEOUT], run_id="r4")}


def test_new_store_is_wal_at_the_latest_schema(tmp_path):
    path = tmp_path / "deep" / "dir" / "inc.db"
    IncidentStore.open(path).close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == schema.LATEST_VERSION
    assert conn.execute("PRAGMA application_id").fetchone()[0] == schema.APPLICATION_ID


def test_default_path_is_the_user_data_dir_unless_the_environment_says(monkeypatch, tmp_path):
    import platformdirs
    from logtriage.incidents import default_db_path
    monkeypatch.delenv("LOGTRIAGE_DB", raising=False)
    assert default_db_path() == Path(platformdirs.user_data_dir("logtriage")) / "incidents.db"
    monkeypatch.setenv("LOGTRIAGE_DB", str(tmp_path / "elsewhere.db"))
    assert default_db_path() == tmp_path / "elsewhere.db"


def test_unwritable_location_is_a_store_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StoreError, match="cannot open incident store"):
        IncidentStore.open(blocker / "inc.db")


def test_newer_schema_is_refused_with_a_clear_error(tmp_path, capsys):
    path = tmp_path / "inc.db"
    IncidentStore.open(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {schema.LATEST_VERSION + 1}")
    conn.close()
    with pytest.raises(StoreError, match="newer than this logtriage knows"):
        IncidentStore.open(path)
    assert main(["incident", "list", "--db", str(path)]) == 5
    err = capsys.readouterr().err
    assert err.startswith("triage: error: ") and "schema version 2" in err and err.count("\n") == 1


def test_other_files_are_refused(tmp_path):
    foreign = tmp_path / "other.db"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE notes (x)")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="other tables"):
        IncidentStore.open(foreign)
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(StoreError):
        IncidentStore.open(junk)


def test_resolve_reopen_and_regression_history(tmp_path, drafts):
    clock = Clock(datetime(2026, 11, 2, 9, 0, tzinfo=timezone.utc))
    with IncidentStore.open(tmp_path / "inc.db", now=clock) as store:
        first = store.add(drafts["keyerror"])
        clock.now += timedelta(hours=1)
        resolved = store.resolve(first.incident.id, "batch keys fixed")
        assert resolved.status is Status.RESOLVED and resolved.resolution_note == "batch keys fixed"
        with pytest.raises(UsageError, match="already resolved"):
            store.resolve(first.incident.id, None)
        clock.now += timedelta(days=1)
        again = store.add(drafts["keyerror2"])
        assert again.outcome is AddOutcome.REGRESSION and again.incident.status is Status.OPEN
        assert again.last_resolution.note == "batch keys fixed"
        store.resolve(first.incident.id, "really fixed")
        reopened = store.reopen(first.incident.id, "flaky again")
        assert reopened.status is Status.OPEN and reopened.resolved_at is None
        with pytest.raises(UsageError, match="no incident 99"):
            store.resolve(99, None)
        kinds = [e.kind for e in store.get(first.incident.id).events]
        assert kinds == [EventKind.CREATED, EventKind.RESOLVED, EventKind.REGRESSED, EventKind.RESOLVED,
                         EventKind.REOPENED]


def test_list_filters(tmp_path, drafts):
    clock = Clock(datetime(2026, 10, 1, tzinfo=timezone.utc))
    with IncidentStore.open(tmp_path / "inc.db", now=clock) as store:
        keyerror = store.add(drafts["keyerror"]).incident.id
        clock.now = datetime(2026, 11, 1, tzinfo=timezone.utc)
        sigkill = store.add(drafts["sigkill"]).incident.id
        timeout = store.add(drafts["timeout"]).incident.id
        store.resolve(timeout, "fixed the skipped allreduce")

        def ids(**kw):
            return [i.id for i in store.list(IncidentFilter(**kw))]
        assert ids() == [timeout, sigkill, keyerror]
        assert ids(category="crash_signal") == [sigkill]
        assert ids(rule="python.exception") == [keyerror]
        assert ids(tags=(("cluster", "a"),)) == [sigkill, keyerror]
        assert ids(tags=(("cluster", "a"),), category="python_exception") == [keyerror]
        assert ids(status=Status.RESOLVED) == [timeout]
        assert ids(status=Status.OPEN, since=datetime(2026, 10, 15, tzinfo=timezone.utc)) == [sigkill]


def test_export_holds_every_occurrence_and_its_report(tmp_path, drafts):
    with IncidentStore.open(tmp_path / "inc.db") as store:
        incident = store.add(drafts["keyerror"]).incident.id
        store.add(drafts["keyerror2"])
        record = store.get(incident, with_reports=True)
    data = json.loads(export(record, "json"))
    assert data["incident"]["occurrence_count"] == 2 and data["incident"]["rule_id"] == "python.exception"
    assert [o["run_id"] for o in data["occurrences"]] == ["r2", "r1"]
    assert all(o["report"]["root_cause"]["rank"] == 2 for o in data["occurrences"])
    assert data["occurrences"][0]["links"] == ["https://t/1"] and data["occurrences"][0]["redacted"] is True
    text = export(record, "md")
    assert text.startswith(f"# Incident {incident}: ")
    assert text.count("#### triage: failed — rank 2: Unhandled Python exception") == 2
    assert "## Occurrence 2 (run r2" in text and "## Occurrence 1 (run r1" in text


def test_stats_by_category_and_rule_over_periods(tmp_path, drafts):
    clock = Clock(datetime(2026, 11, 2, 10, tzinfo=timezone.utc))        # a Monday
    with IncidentStore.open(tmp_path / "inc.db", now=clock) as store:
        store.add(drafts["keyerror"])
        store.add(drafts["sigkill"])
        clock.now = datetime(2026, 11, 4, tzinfo=timezone.utc)           # same week
        store.add(drafts["keyerror2"])
        clock.now = datetime(2026, 11, 10, tzinfo=timezone.utc)          # next week
        store.add(drafts["keyerror"])
        rows = store.occurrence_rows()
    weekly = occurrence_stats(rows, by="category", period="week")
    as_tuples = [(str(p.date()), k, o, i) for p, k, o, i in
                 weekly[["period", "key", "occurrences", "incidents"]].itertuples(index=False)]
    assert as_tuples == [("2026-11-02", "crash_signal", 1, 1), ("2026-11-02", "python_exception", 2, 1),
                         ("2026-11-09", "python_exception", 1, 1)]
    monthly = occurrence_stats(rows, by="rule", period="month")
    assert dict(zip(monthly["key"], monthly["occurrences"])) == {"python.exception": 3, "signal.sigkill": 1}
    daily = occurrence_stats(rows, by="rule", period="day")
    assert len(daily) == 4

    write_table(weekly, csv=str(tmp_path / "w.csv"), parquet=str(tmp_path / "w.parquet"))
    back = pd.read_csv(tmp_path / "w.csv")
    assert list(back.columns) == ["period", "key", "occurrences", "incidents", "open_incidents"]
    assert back["occurrences"].tolist() == [1, 2, 1] and back["period"].tolist()[0] == "2026-11-02"
    parquet = pd.read_parquet(tmp_path / "w.parquet")
    assert parquet["occurrences"].sum() == 4 and str(parquet["period"].dtype).startswith("datetime64")


def test_cli_add_list_show_export_resolve(tmp_path, capsys, monkeypatch):
    db = str(tmp_path / "cli.db")
    monkeypatch.setenv("LOGTRIAGE_DB", db)
    assert main(["incident", "add", KEYERROR, "--run-id", "job-1", "--tag", "cluster=a"]) == 0
    assert "(new)" in capsys.readouterr().out
    assert main(["incident", "add", str(CPU / "rank_exception__np2.log"), "--run-id", "job-2"]) == 0
    out = capsys.readouterr().out
    assert "incident 1 (repeat)" in out and "2nd occurrence; previous runs: run job-1 (" in out
    assert main(["incident", "--db", db, "add", SIGKILL]) == 0                  # --db before the action works too
    capsys.readouterr()
    assert main(["incident", "list", "--tag", "cluster=a"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].split()[:3] == ["ID", "STATUS", "SEEN"] and len(listed) == 2 and "python.exception" in listed[1]
    assert main(["incident", "show", "1"]) == 0
    shown = capsys.readouterr().out
    assert "incident 1 · open · python_exception · python.exception" in shown and "run job-2" in shown
    assert main(["incident", "resolve", "1", "--note", "fixed"]) == 0
    assert main(["incident", "export", "1", "--format", "json", "-o", str(tmp_path / "x.json")]) == 0
    assert json.loads((tmp_path / "x.json").read_text())["incident"]["status"] == "resolved"
    assert main(["incident", "stats", "--by", "rule", "--csv", str(tmp_path / "s.csv")]) == 0
    assert "python.exception" in capsys.readouterr().out and (tmp_path / "s.csv").exists()
    assert main(["incident", "check"]) == 0
    assert main(["incident", "show", "42"]) == 2


def test_cli_refuses_a_log_without_a_failure_and_bad_tags(tmp_path, capsys):
    db = str(tmp_path / "x.db")
    assert main(["incident", "add", str(CPU / "healthy__np2.log"), "--db", db]) == 1
    assert "nothing to record" in capsys.readouterr().err
    assert main(["incident", "add", KEYERROR, "--tag", "novalue", "--db", db]) == 2
    assert main(["incident", "add", KEYERROR, "--redact", "emails", "--db", db]) == 2
    assert main(["incident", "list", "--since", "last tuesday", "--db", db]) == 2
