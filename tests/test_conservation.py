"""Line conservation, line by line, on every captured sample and on the ways a log arrives
(file, folder, .gz, standard input): each physical line has its byte offset and exactly one
slot, that slot resolves to one stream, and the report's per-stream counts are exactly those
per-line assignments; the report's input lines equal the file's physical lines."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from logtriage.api import run_triage
from logtriage.regress.cases import find_cases
from logtriage.scan import copy_spool
from tests.conftest import SAMPLES
from tests.fuzz.cli import run_cli
from tests.fuzz.invariants import check_conservation
from tests.fuzz.strategies import physical_lines

CASES = find_cases(SAMPLES)


def _streams_from_lines(run) -> Counter:
    """Lines per stream label, counted from the per-line slot index."""
    counts: Counter = Counter()
    for index in run.scan.indexes:
        for slot in index.slots:
            counts[run.diagnosis.keys[run.scan.slots.final(slot)].label()] += 1
    return counts


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_sample_line_is_in_exactly_one_stream(case):
    run = run_triage([str(case.log)])
    files = [Path(str(s.path)) for s in run.scan.sources]
    check_conservation(run, files)
    report = run.report.to_dict()
    assert {s["stream"]: s["lines"] for s in report["streams"]} == dict(_streams_from_lines(run))


def test_stdin_is_conserved_and_its_spool_is_byte_exact(tmp_path):
    data = (SAMPLES / "cpu" / "rank_exception__np4.log").read_bytes().replace(b"\n", b"\r\n", 7) + b"no newline"
    out = run_cli("-", "--format", "json", stdin=data)
    assert out.code == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["input_lines"] == len(physical_lines(data)) == sum(s["lines"] for s in report["streams"])
    assert report["root_cause"]["rank"] == 2


def test_spool_copy_equals_standard_input(tmp_path, monkeypatch):
    import io
    import sys
    data = b"[rank0]: step 1\r\n[rank1]: KeyError: 1\n\x00\xff tail without newline"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(io.BytesIO(data))))
    run = run_triage(["-"])
    copy = io.BytesIO()
    copy_spool(run.scan.indexes[0], copy)
    assert copy.getvalue() == data
    assert list(run.scan.indexes[0].offsets) == [0, 17, 38]


def test_gzip_and_plain_give_the_same_per_line_assignment(tmp_path):
    data = (SAMPLES / "cpu" / "rank_exception__np4.log").read_bytes()
    plain, packed = tmp_path / "run.log", tmp_path / "run.log.gz"
    plain.write_bytes(data)
    packed.write_bytes(gzip.compress(data))
    a, b = run_triage([str(plain)]), run_triage([str(packed)])
    assert list(a.scan.indexes[0].offsets) == list(b.scan.indexes[0].offsets)
    assert _streams_from_lines(a) == _streams_from_lines(b)
