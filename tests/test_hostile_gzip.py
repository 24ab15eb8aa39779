"""Truncated and corrupt .gz inputs: a report on the lines that could be read, the damage named
in the report's problems and on stderr, exit code 3 (docs/hostile-input.md)."""

from __future__ import annotations

import gzip
import os
import random

import pytest

from logtriage.api import run_triage
from tests.fuzz.cli import assert_clean_exit, run_cli
from tests.fuzz.invariants import check_conservation, check_outputs

STEPS = "".join(f"[rank{i % 4}]: step {i} loss 0.1\n" for i in range(400))
FAILURE = "[rank2]: Traceback (most recent call last):\n[rank2]:   File \"train.py\", line 9, in <module>\n" \
          "[rank2]: KeyError: 'target'\n"


def _gz(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_truncated_gz_reports_what_was_readable(tmp_path):
    tail = random.Random(1).randbytes(30_000).replace(b"\n", b" ")   # incompressible: the cut lands in it
    whole = gzip.compress((STEPS + FAILURE).encode() + tail)
    path = _gz(tmp_path, "run.log.gz", whole[:-20_000])
    run = run_triage([str(path)])
    report = run.report.to_dict()
    assert report["verdict"] == "failed"
    assert (report["root_cause"]["rank"], report["root_cause"]["line"]) == (2, 403)
    assert report["root_cause"]["exception_type"] == "KeyError"
    assert report["input_lines"] == 403            # the cut binary line is not a line
    assert run.scan.unreadable and "truncated" in run.scan.unreadable[0]
    assert any("corrupt or truncated" in p for p in report["problems"])
    check_conservation(run, [path])
    check_outputs(run)


def test_truncated_gz_on_the_command_line_exits_3_after_the_report(tmp_path):
    whole = gzip.compress((STEPS + FAILURE).encode() + os.urandom(30_000).replace(b"\n", b" "))
    path = _gz(tmp_path, "run.log.gz", whole[:-20_000])
    out = run_cli(str(path))
    assert_clean_exit(out)
    assert out.code == 3
    assert out.stdout.startswith(b"triage: FAILED")
    assert b"warning:" in out.stderr and b"run.log.gz" in out.stderr


@pytest.mark.parametrize("data", [
    b"\x1f\x8b",                                          # the magic alone
    b"\x1f\x8bTraceback (most recent call last):\n",      # the magic, then no gzip header
    gzip.compress(b"[rank0]: KeyError: 1\n")[:12],        # a header cut short
], ids=["magic-only", "bad-header", "short-header"])
def test_gzip_magic_without_gzip_data(tmp_path, data):
    """Damage in the first lines (where the prefix dialect is sampled) used to escape as a traceback."""
    path = _gz(tmp_path, "bad.gz", data)
    run = run_triage([str(path)])
    assert run.report.input_lines == 0
    assert run.report.verdict == "ok"
    assert run.scan.unreadable
    out = run_cli(str(path))
    assert_clean_exit(out)
    assert out.code == 3
    assert out.stdout == b""                    # no "OK" report for a log nothing could be read of
    assert out.stderr.startswith(b"triage: error: ") and out.stderr.count(b"\n") == 1


def test_corrupt_gz_in_a_folder_keeps_the_other_files(tmp_path):
    (tmp_path / "rank0.log").write_text("[rank0]: step 1 loss 0.1\n[rank0]: KeyError: 'x'\n")
    good = gzip.compress(b"[rank1]: step 1 loss 0.1\n" * 50)
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF                             # flipped bits: CRC or inflate error
    (tmp_path / "rank1.log.gz").write_bytes(bytes(bad))
    run = run_triage([str(tmp_path)])
    report = run.report.to_dict()
    assert report["root_cause"]["rank"] == 0
    assert len(run.scan.unreadable) == 1 and "rank1.log.gz" in run.scan.unreadable[0]
    assert report["input_lines"] == sum(s["lines"] for s in report["streams"])


def test_gzip_magic_in_a_plain_log_on_stdin(tmp_path):
    out = run_cli("-", stdin=b"\x1f\x8b\x08\x00garbage\n[rank0]: KeyError: 1\n")
    assert_clean_exit(out)
    assert out.code == 3
