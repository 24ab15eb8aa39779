"""Property tests of the whole library pipeline on generated log-like bytes: `run_triage` never
raises, conserves lines (every physical line in exactly one stream, at its own number, for one
file and for a folder of per-rank files), renders valid JSON and control-free text/Markdown."""

from __future__ import annotations

import gzip
import itertools
import tempfile
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from logtriage.api import run_triage
from tests.fuzz.budget import TRIED, fuzz_settings, report_tried
from tests.fuzz.invariants import check_conservation, check_outputs, triage_bytes
from tests.fuzz.strategies import inflated_logs, log_bytes

_COUNTER = itertools.count()
FIXTURES = Path(__file__).resolve().parent / "data" / "hostile"
# file -> (verdict, root rule category, rank, line, exception type); see data/hostile/README.md
EXPECTED = {
    "escapes.log": ("failed", "python_exception", 1, 5, "KeyError"),
    "mixed_encoding.log": ("failed", "python_exception", 1, 4, "FileNotFoundError"),   # a data file (stop 28)
    "tqdm_glued.log": ("failed", "python_exception", 2, 3, "ValueError"),
    "garbled_prefixes.log": ("failed", "python_exception", 3, 10, "IndexError"),
    "only_prefixes.log": ("ok", None, None, None, None),
    "nul_binary.log": ("failed", "python_exception", 0, 3, "RuntimeError"),
    "crlf_no_final_newline.log": ("failed", "python_exception", 1, 4, "KeyError"),
}


@pytest.fixture(scope="module", autouse=True)
def _tried(request):
    yield
    report_tried(request, "pipeline.")


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="logtriage-fuzz-") as name:
        yield Path(name)


@fuzz_settings(1200)
@example(b"\x1f\x8b")                                   # found: gzip magic alone escaped as a traceback
@example(b"[1,99999999999999999999999]<stdout>: KeyError: 1")   # found: a rank too big for JSON
@example(b"\n<script>\x1b[31mE1130 01:09:25.541000 23736 torch/distributed/elastic/multiprocessing/api.py:1002] "
         b"failed (exitcode: 1) local_rank: 0 (pid: 23742) of binary: /usr/bin/python")
@given(data=log_bytes())
def test_any_log_bytes(workdir, data):
    TRIED["pipeline.file"] += 1
    triage_bytes(data, workdir, f"fuzz{next(_COUNTER)}.log")


@fuzz_settings(80)
@given(data=inflated_logs())
def test_real_lines_with_absurd_numbers(workdir, data):
    """Found: 30-digit ranks from rule captures overflowed the JSON report; 5000-digit pids crashed int()."""
    TRIED["pipeline.inflated"] += 1
    triage_bytes(data, workdir, f"fuzz{next(_COUNTER)}.log")


@fuzz_settings(150)
@given(data=log_bytes(max_lines=30))
def test_any_log_bytes_gzipped(workdir, data):
    TRIED["pipeline.gzip"] += 1
    triage_bytes(gzip.compress(data), workdir, f"fuzz{next(_COUNTER)}.log.gz")


@fuzz_settings(200)
@given(files=st.lists(log_bytes(max_lines=25), min_size=1, max_size=4),
       layout=st.sampled_from(["rank{}.log", "attempt_0/{}/stderr.log", "worker-{}.out"]))
def test_any_folder_of_per_rank_files(workdir, files, layout):
    TRIED["pipeline.folder"] += 1
    folder = workdir / f"dir{next(_COUNTER)}"
    paths = []
    for rank, data in enumerate(files):
        path = folder / layout.format(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        paths.append(path)
    run = run_triage([str(folder)])
    by_name = {str(p): p for p in paths}
    check_conservation(run, [by_name[str(s.path)] for s in run.scan.sources])
    check_outputs(run)


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.log")))
def test_hostile_fixture(name):
    """Every fixture (and every reduced fuzzer find added there) keeps the invariants and its diagnosis."""
    path = FIXTURES / name
    run = run_triage([str(path)])
    check_conservation(run, [path])
    check_outputs(run)
    rc = run.report.root_cause
    got = (run.report.verdict, rc.category, rc.rank, rc.line, rc.exception_type) if rc else (run.report.verdict,) + (None,) * 4
    assert got == EXPECTED[name]
