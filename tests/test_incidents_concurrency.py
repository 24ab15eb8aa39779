"""Many writers at once all land; a writer killed mid-transaction leaves a consistent, usable store."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import random
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from logtriage.incidents import IncidentStore, record_logs
from logtriage.incidents.store import CRASH_ENV

ROOT = Path(__file__).resolve().parents[1]
CPU = ROOT / "sample_logs" / "cpu"
WRITERS = 8
ADDS_EACH = 50


@pytest.fixture(scope="module")
def drafts():
    return (record_logs([str(CPU / "rank_exception__np4.log")]), record_logs([str(CPU / "rank_sigkill__np2.log")]))


def _writer(db: str, drafts, worker: int, barrier, times) -> None:
    store = IncidentStore.open(db)
    barrier.wait(timeout=60)
    start = time.time()
    for n in range(ADDS_EACH):
        store.add(replace(drafts[n % 2], run_id=f"w{worker}-{n}", tags=(("worker", str(worker)),)))
    store.close()
    times.put((start, time.time()))


def test_eight_processes_adding_fifty_each_all_land(tmp_path, drafts):
    db = str(tmp_path / "busy.db")
    ctx = multiprocessing.get_context("spawn")     # fresh interpreters, no inherited threads or locks
    barrier, times = ctx.Barrier(WRITERS), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(db, drafts, w, barrier, times)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    spans = [times.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0] * WRITERS
    elapsed = max(end for _, end in spans) - min(start for start, _ in spans)
    print(f"\n{WRITERS} writers x {ADDS_EACH} adds, from the common start: {elapsed:.2f}s "
          f"({WRITERS * ADDS_EACH / elapsed:.0f} adds/s)")

    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert conn.execute("SELECT count(*) FROM occurrences").fetchone()[0] == WRITERS * ADDS_EACH
    assert conn.execute("SELECT count(DISTINCT run_id) FROM occurrences").fetchone()[0] == WRITERS * ADDS_EACH
    counts = dict(conn.execute("SELECT rule_id, occurrence_count FROM incidents"))
    assert counts == {"python.exception": WRITERS * ADDS_EACH // 2, "signal.sigkill": WRITERS * ADDS_EACH // 2}
    assert conn.execute("SELECT count(*) FROM events WHERE kind = 'created'").fetchone()[0] == 2
    conn.close()
    with IncidentStore.open(db) as store:
        assert store.problems() == []


def _counts(db: str) -> tuple[int, int]:
    """(occurrence rows, sum of incident counters); (0, 0) before the schema exists."""
    if not Path(db).exists():
        return 0, 0
    conn = sqlite3.connect(db)
    try:
        return (conn.execute("SELECT count(*) FROM occurrences").fetchone()[0],
                conn.execute("SELECT coalesce(sum(occurrence_count), 0) FROM incidents").fetchone()[0])
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return 0, 0
        raise
    finally:
        conn.close()


def test_add_killed_inside_its_transaction_leaves_nothing_half_written(tmp_path):
    db = str(tmp_path / "killed.db")
    log = str(CPU / "rank_exception__np4.log")
    base = [sys.executable, "-m", "logtriage", "incident", "add", log, "--db", db]
    assert subprocess.run(base + ["--run-id", "ok-1"], cwd=ROOT, capture_output=True, timeout=60).returncode == 0
    killed = subprocess.run(base + ["--run-id", "killed"], cwd=ROOT, capture_output=True, timeout=60,
                            env={**os.environ, CRASH_ENV: "add"})
    assert killed.returncode == -signal.SIGKILL               # died after writing its occurrence row, before COMMIT
    assert Path(f"{db}-wal").exists()                        # and left its WAL behind

    with IncidentStore.open(db) as store:
        assert store.problems() == []
        record = store.get(1)
        assert record.incident.occurrence_count == 1 and [o.run_id for o in record.occurrences] == ["ok-1"]
    assert subprocess.run(base + ["--run-id", "ok-2"], cwd=ROOT, capture_output=True, timeout=60).returncode == 0
    assert _counts(db) == (2, 2)


LOOP = """
import pickle, sys
from dataclasses import replace
from logtriage.incidents import IncidentStore
drafts = pickle.load(open(sys.argv[2], "rb"))
store = IncidentStore.open(sys.argv[1])
n = 0
while True:
    store.add(replace(drafts[n % 2], run_id=f"loop-{sys.argv[3]}-{n}"))
    n += 1
"""


def test_writers_killed_at_random_moments_leave_a_consistent_store(tmp_path, drafts):
    db = str(tmp_path / "random.db")
    pickled = tmp_path / "drafts.pickle"
    pickled.write_bytes(pickle.dumps(drafts))
    rng = random.Random(20261130)
    for round_ in range(4):
        before = _counts(db)[0]
        child = subprocess.Popen([sys.executable, "-c", LOOP, db, str(pickled), str(round_)], cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            deadline = time.monotonic() + 30
            while _counts(db)[0] < before + 5:              # wait until it is busy writing
                assert child.poll() is None, "the writer died on its own"
                assert time.monotonic() < deadline, "the writer wrote nothing in 30 s"
                time.sleep(0.02)
            time.sleep(rng.uniform(0, 0.05))
        finally:
            child.kill()                                    # SIGKILL, also when an assertion failed
            child.wait(timeout=10)
        assert child.returncode == -signal.SIGKILL
        occurrences, counted = _counts(db)
        assert occurrences == counted and occurrences >= before + 5
        with IncidentStore.open(db) as store:
            assert store.problems() == []
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
