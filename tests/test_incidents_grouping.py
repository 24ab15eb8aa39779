"""Fingerprints group the same failure across runs, ranks and timestamps, and only that."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from logtriage.api import TriageOptions, triage
from logtriage.incidents import AddOutcome, IncidentStore, record_logs
from logtriage.incidents import fingerprint as fp_module
from logtriage.incidents.fingerprint import all_fingerprints, fingerprint

ROOT = Path(__file__).resolve().parents[1]
CPU = ROOT / "sample_logs" / "cpu"


def shifted_copy(src: Path, dst: Path) -> Path:
    """Another 'run' of the same failure: new clock, new pids, and rank 2's role played by rank 3."""
    text = src.read_text(encoding="utf-8")
    text = re.sub(r"W1130 01:04:0(\d)", lambda m: f"W1201 13:22:4{m.group(1)}", text)
    text = re.sub(r"E1130 01:04:0(\d)", lambda m: f"E1201 13:22:4{m.group(1)}", text)
    text = re.sub(r"\b166(\d\d)\b", lambda m: f"412{m.group(1)}", text)
    text = text.replace("rank2]", "rankX]").replace("rank3]", "rank2]").replace("rankX]", "rank3]")
    text = text.replace("[rank 2]", "[rank X]").replace("[rank 3]", "[rank 2]").replace("[rank X]", "[rank 3]")
    text = re.sub(r"local_rank: 2\b", "local_rank: 3", text)
    text = re.sub(r"rank\s+: 2\b", "rank      : 3", text)
    dst.write_text(text, encoding="utf-8")
    return dst


def test_volatile_parts_are_masked_and_the_version_is_in_the_key():
    a = fingerprint("signal.sigkill", "crash_signal",
                    "E1130 01:06:59.552000 20328 torch/distributed/elastic/multiprocessing/api.py:1002] "
                    "failed (exitcode: -9) local_rank: 1 (pid: 20332) of binary: /tmp/a/.venv/bin/python")
    b = fingerprint("signal.sigkill", "crash_signal",
                    "E0412 22:10:01.000001 777 torch/distributed/elastic/multiprocessing/api.py:882] "
                    "failed (exitcode: -9) local_rank: 3 (pid: 991) of binary: /opt/conda/bin/python3")
    assert a.key == b.key and a.key.startswith("v1:")
    assert a.basis == "signal.sigkill|crash_signal|failed (exitcode: -9) local_rank: <n> (pid: <n>) of binary: <path>"
    # The exit code is the diagnosis: kept.
    c = fingerprint("signal.exit_nonzero", "unknown", "failed (exitcode: 3) local_rank: 1 (pid: 5) of binary: /x/y")
    d = fingerprint("signal.exit_nonzero", "unknown", "failed (exitcode: 1) local_rank: 1 (pid: 5) of binary: /x/y")
    assert c.key != d.key


@pytest.mark.parametrize("one,two", [
    ("[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1132079, OpType=ALLREDUCE, "
     "NumelIn=304640, NumelOut=304640, Timeout(ms)=1800000) ran for 1800414 milliseconds before timing out.",
     "[E626 06:24:44.903881913 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout: "
     "WorkNCCL(SeqNum=808, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600090 milliseconds "
     "before timing out."),
    ("socketStartConnect: Connect to 192.168.19.14<52822> failed : No route to host",
     "socketStartConnect: Connect to 10.0.7.3<41000> failed : No route to host"),
    ("slurmstepd: error: *** STEP 32233190.0 ON nid00001 CANCELLED AT 2020-07-03T02:59:56 DUE TO TIME LIMIT ***",
     "slurmstepd: error: *** STEP 4410.0 ON gpu-a17 CANCELLED AT 2024-01-13T11:00:00 DUE TO TIME LIMIT ***"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 14.06 GiB. GPU 2 has a total capacity of "
     "79.25 GiB of which 6.96 GiB is free.",
     "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 132.00 MiB. GPU 3 has a total capacity of "
     "79.10 GiB of which 98.00 MiB is free."),
    ("Duplicate GPU detected : rank 3 and rank 0 both on CUDA device f000",
     "Duplicate GPU detected : rank 1 and rank 2 both on CUDA device 1000"),
])
def test_same_failure_elsewhere_same_key(one, two):
    assert fingerprint("r", "c", one).key == fingerprint("r", "c", two).key


def test_different_failures_different_keys():
    base = fingerprint("python.exception", "python_exception", "KeyError: 'target'")
    assert fingerprint("python.exception", "python_exception", "KeyError: 'label'").key != base.key
    assert fingerprint("python.exception", "python_exception", "ValueError: 'target'").key != base.key
    assert fingerprint("ckpt.not_found", "checkpoint", "KeyError: 'target'").key != base.key
    watchdog = "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType={}, Timeout(ms)=10)"
    assert fingerprint("n", "c", watchdog.format("ALLREDUCE")).key != fingerprint("n", "c", watchdog.format("BROADCAST")).key


def test_two_runs_of_the_same_failure_one_incident_a_different_failure_another(tmp_path):
    variant = shifted_copy(CPU / "rank_exception__np4.log", tmp_path / "rank_exception_rerun.log")
    rerun = triage([str(variant)], TriageOptions(redact=False))
    assert rerun.root_cause.rank == 3 and rerun.root_cause.rule_id == "python.exception"   # really another rank

    with IncidentStore.open(tmp_path / "inc.db") as store:
        first = store.add(record_logs([str(CPU / "rank_exception__np4.log")], run_id="run-a"))
        second = store.add(record_logs([str(variant)], run_id="run-b"))
        third = store.add(record_logs([str(CPU / "rank_exception__np2.log")], run_id="run-c"))   # rank 1, 2 ranks
        other = store.add(record_logs([str(CPU / "rank_sigkill__np2.log")], run_id="run-d"))
        again = store.add(record_logs([str(CPU / "rank_sigkill__np4.log")], run_id="run-e"))

        assert (first.outcome, second.outcome, third.outcome) == (AddOutcome.NEW, AddOutcome.REPEAT, AddOutcome.REPEAT)
        assert first.incident.id == second.incident.id == third.incident.id
        assert third.incident.occurrence_count == 3
        assert [o.run_id for o in third.previous] == ["run-b", "run-a"]
        assert other.outcome is AddOutcome.NEW and other.incident.id != first.incident.id
        assert other.incident.rule_id == "signal.sigkill" and other.incident.category == "crash_signal"
        assert again.incident.id == other.incident.id and again.incident.occurrence_count == 2

        record = store.get(first.incident.id)
        assert [(o.run_id, o.rank) for o in record.occurrences] == [("run-c", 1), ("run-b", 3), ("run-a", 2)]
        assert len(store.list()) == 2


def test_redacted_and_unredacted_records_of_one_failure_group_together(tmp_path):
    log = str(CPU / "rank_exception__np3.log")
    with IncidentStore.open(tmp_path / "inc.db") as store:
        a = store.add(record_logs([log], redact=True, redact_extra=("hosts", "paths", "ips")))
        b = store.add(record_logs([log], redact=False))
        assert b.incident.id == a.incident.id and b.outcome is AddOutcome.REPEAT
        occurrences = store.get(a.incident.id).occurrences
        assert [(o.redacted, o.redact_extra) for o in occurrences] == [(False, ()), (True, ("hosts", "paths", "ips"))]


def test_an_algorithm_upgrade_does_not_regroup_old_incidents(tmp_path, monkeypatch):
    keyerror = str(CPU / "rank_exception__np4.log")
    with IncidentStore.open(tmp_path / "inc.db") as store:
        old = store.add(record_logs([keyerror]))
        assert old.incident.fingerprint.startswith("v1:")

        # Version 2 hashes differently (here: it also lowercases); version 1 is kept for lookups.
        def basis_v2(rule_id, category, text):
            return fp_module.ALGORITHMS[1](rule_id, category, text).lower()
        monkeypatch.setitem(fp_module.ALGORITHMS, 2, basis_v2)
        monkeypatch.setattr(fp_module, "CURRENT_VERSION", 2)
        prints = all_fingerprints("python.exception", "python_exception", "KeyError: 'target'")
        assert [p.version for p in prints] == [2, 1] and prints[0].hash != prints[1].hash

        repeat = store.add(record_logs([keyerror]))
        assert repeat.incident.id == old.incident.id and repeat.outcome is AddOutcome.REPEAT
        assert repeat.incident.fingerprint == old.incident.fingerprint          # the incident keeps its v1 key
        newer = store.get(old.incident.id).occurrences[0]
        assert newer.fingerprint.startswith("v2:")                              # the occurrence records its own
        fresh = store.add(record_logs([str(CPU / "rank_sigkill__np2.log")]))
        assert fresh.outcome is AddOutcome.NEW and fresh.incident.fingerprint.startswith("v2:")
        assert store.problems() == []
