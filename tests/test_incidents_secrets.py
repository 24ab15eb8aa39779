"""Nothing secret reaches the incident database: not the main file, not the WAL, not the shm."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from logtriage.cli import main
from logtriage.incidents import IncidentStore

from test_redact_reports import SECRETS, planted_log


def database_bytes(db: Path) -> bytes:
    return b"".join(p.read_bytes() for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm")) if p.exists())


def leaked(blob: bytes) -> list[str]:
    return [name for name, value in SECRETS.items() if value.encode() in blob]


def test_planted_secrets_never_reach_the_database_files(tmp_path, capsys):
    log = planted_log(tmp_path, with_probe=True)
    db = tmp_path / "inc.db"
    IncidentStore.open(db).close()
    holder = sqlite3.connect(db)                     # an open reader keeps the WAL file on disk
    holder.execute("SELECT count(*) FROM incidents").fetchone()
    assert main(["incident", "add", str(log), "--db", str(db), "--run-id", "run-1",
                 "--link", f"https://bot:{SECRETS['url_password']}@tracker.internal/T-7",
                 "--tag", f"token={SECRETS['hf']}"]) == 0
    assert main(["incident", "add", str(log), "--db", str(db), "--redact", "hosts,paths,ips"]) == 0
    assert "2nd occurrence" in capsys.readouterr().out
    assert Path(f"{db}-wal").stat().st_size > 0
    assert leaked(database_bytes(db)) == []
    holder.close()
    assert leaked(database_bytes(db)) == []          # after the last close and its checkpoint

    for fmt in ("md", "json"):
        assert main(["incident", "export", "1", "--db", str(db), "--format", fmt]) == 0
        assert leaked(capsys.readouterr().out.encode()) == []
    assert main(["incident", "show", "1", "--db", str(db)]) == 0
    shown = capsys.readouterr().out
    assert leaked(shown.encode()) == [] and "[REDACTED:hf_token]" in shown


def test_no_redact_stores_them_and_says_so(tmp_path, capsys):
    """The control: the same add with --no-redact does put the secrets in the file."""
    log = planted_log(tmp_path, with_probe=True)
    db = tmp_path / "raw.db"
    assert main(["incident", "add", str(log), "--db", str(db), "--no-redact"]) == 0
    assert sorted(leaked(database_bytes(db))) == sorted(SECRETS)
    capsys.readouterr()
    assert main(["incident", "show", "1", "--db", str(db)]) == 0
    assert "NOT redacted" in capsys.readouterr().out
