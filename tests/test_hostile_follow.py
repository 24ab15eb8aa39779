"""`triage --follow`: a pipe that never closes and a file that grows or is truncated while it is
followed; findings arrive as lines while the input is still open, the report at the end."""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from logtriage.follow_inputs import LineSplitter
from logtriage.ingest.reader import MAX_LINE, TAIL, iter_raw_lines
from logtriage.ingest.sources import Source
from tests.fuzz.budget import TRIED, fuzz_settings
from tests.fuzz.cli import ROOT, assert_clean_exit, environment, run_cli
from tests.fuzz.strategies import log_bytes, physical_lines

FAILURE = b"[rank1]: Traceback (most recent call last):\n[rank1]:   File \"t.py\", line 1, in <module>\n" \
          b"[rank1]: KeyError: 'shard'\n"
CASCADE = b"[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] " \
          b"Connection closed by peer [127.0.0.1]:29500\n"


def start(*args: str, stdin=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "logtriage", "--follow", *args], stdin=stdin,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment(), cwd=ROOT)


def read_line(proc: subprocess.Popen, timeout: float = 10) -> bytes:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "no output in time"
    return proc.stdout.readline()


@fuzz_settings(200)
@given(data=log_bytes(), cuts=st.lists(st.integers(0, 2000), max_size=8))
def test_line_splitter_gives_the_physical_lines_whatever_the_chunks(data, cuts):
    TRIED["follow.splitter"] += 1
    splitter, got, start = LineSplitter(), [], 0
    for cut in sorted(c % (len(data) + 1) for c in cuts) + [len(data)]:
        got += splitter.feed(data[start:cut])
        start = max(start, cut)
    got += splitter.flush()
    lines = physical_lines(data)
    assert [raw for _, raw in got] == lines
    offsets, at = [], 0
    for raw in lines:
        offsets.append(at)
        at += len(raw) + 1
    assert [offset for offset, _ in got] == offsets


def test_line_splitter_bounds_an_overlong_line():
    splitter = LineSplitter()
    got = []
    for _ in range(5):
        got += splitter.feed(b"x" * MAX_LINE)
    got += splitter.feed(b"\nnext\n")
    # head, the ` [...] ` mark, the last 64 KiB (ingest.reader keeps the same)
    assert [(o, len(r)) for o, r in got] == [(0, MAX_LINE + 7 + TAIL), (5 * MAX_LINE + 1, 4)]


def test_line_splitter_keeps_what_the_reader_keeps_of_an_overlong_line(tmp_path):
    """The end of a huge line is where a glued rank line sits: --follow must not lose it."""
    data = b"a" * (MAX_LINE + 5000) + b"[rank1]: RuntimeError: boom\nshort\n" + b"b" * (MAX_LINE + 3)
    (tmp_path / "long.log").write_bytes(data)
    expected = list(iter_raw_lines(Source(0, "long.log", tmp_path / "long.log")))
    splitter, got = LineSplitter(), []
    for at in range(0, len(data), 70_000):
        got += splitter.feed(data[at:at + 70_000])
    got += splitter.flush()
    assert got == expected
    assert got[0][1] == b"a" * MAX_LINE + b" [...] " + b"a" * 5000 + b"[rank1]: RuntimeError: boom"


def test_stdin_that_stays_open_gets_findings_line_by_line():
    proc = start("-", stdin=subprocess.PIPE)
    try:
        proc.stdin.write(b"[rank0]: step 1 loss 0.1\n[rank1]: step 1 loss 0.2\n" + FAILURE)
        proc.stdin.flush()
        first = read_line(proc)
        assert first.startswith(b"finding: <stdin>:5 rank 1 python.exception: KeyError: 'shard'"), first
        assert proc.poll() is None                                    # still following
        proc.stdin.write(CASCADE)
        proc.stdin.flush()
        second = read_line(proc)
        assert b"<stdin>:6 rank 0 gloo.connection_closed" in second, second
        # the last line without a newline, then end of input: the report
        out, err = proc.communicate(b"[rank0]: no newline at the end", timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert err == b""
    report = out.decode()
    assert "triage: FAILED — rank 1: KeyError: 'shard'" in report
    assert "7 lines read" in report


def test_followed_stdin_json_report_conserves_lines():
    data = b"[rank0]: step 1\r\n" + FAILURE + CASCADE + b"\x00\xff binary\n[rank2]: tail"
    out = run_cli("--follow", "-", "--format", "json", stdin=data)
    assert_clean_exit(out)
    head, _, body = out.stdout.partition(b"\n\n")
    assert head.count(b"finding:") == 2
    report = json.loads(body)
    assert report["input_lines"] == len(physical_lines(data)) == sum(s["lines"] for s in report["streams"])
    assert report["root_cause"]["rank"] == 1 and report["root_cause"]["line"] == 4


def test_growing_then_truncated_file(tmp_path):
    log = tmp_path / "train.log"
    log.write_bytes(b"[rank0]: step 1\n[rank1]: step 1\n")
    proc = start(str(log))
    try:
        time.sleep(0.8)
        with log.open("ab") as out:
            out.write(FAILURE)
        first = read_line(proc)
        assert first.startswith(f"finding: {log}:5 rank 1 python.exception: KeyError".encode()), first
        log.write_bytes(b"[rank2]: ValueError: after truncation\n")     # shrinks: read again from line 1
        second = read_line(proc)
        assert second.startswith(f"finding: {log}:1 rank 2 python.exception: ValueError".encode()), second
        with log.open("ab") as out:
            out.write(b"[rank3]: step 7\n")
        time.sleep(0.8)
        proc.send_signal(signal.SIGINT)                                # how following ends
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert b"shrank (truncated or replaced)" in err and b"Traceback" not in err
    report = out.decode()
    assert "triage: FAILED — rank 2: ValueError: after truncation" in report
    assert "2 lines read" in report


def test_replaced_file_is_read_from_its_start(tmp_path):
    log = tmp_path / "train.log"
    log.write_bytes(b"[rank0]: step 1\n" * 2 + CASCADE)
    proc = start(str(log), "--format", "json")
    try:
        # the follower has read the first file once it reports that file's finding (a fixed sleep was too short
        # on a loaded machine: the file was replaced before it was opened, and nothing shrank)
        assert read_line(proc, timeout=60).startswith(f"finding: {log}:3 rank 0".encode())
        fresh = tmp_path / "new.log"
        fresh.write_bytes(b"[rank4]: step 1\n" * 5 + FAILURE)
        fresh.replace(log)                                             # rotation: a new inode
        first = read_line(proc)
        assert first.startswith(f"finding: {log}:8 rank 1".encode()), first
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and b"shrank" in err
    report = json.loads(out[out.index(b"{"):])
    assert report["input_lines"] == 8


def test_follow_into_a_closed_pipe_ends_quietly():
    proc = subprocess.Popen(
        f"{sys.executable} -m logtriage --follow - | head -1", shell=True, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment(), cwd=ROOT)
    data = FAILURE + b"".join(CASCADE.replace(b"rank0", b"rank%d" % r) for r in range(2, 60))
    out, err = proc.communicate(data, timeout=30)
    assert out.startswith(b"finding: <stdin>:3 rank 1") and out.count(b"\n") == 1
    assert err == b""


@pytest.mark.parametrize("args, message", [
    (("a.log", "b.log"), b"--follow takes one file"),
    ((str(ROOT / "sample_logs"),), b"not a folder"),
])
def test_follow_usage_errors(args, message):
    out = run_cli("--follow", *args)
    assert_clean_exit(out)
    assert out.code == 2 and message in out.stderr


def test_follow_refuses_a_compressed_file(tmp_path):
    import gzip
    path = tmp_path / "run.log.gz"
    path.write_bytes(gzip.compress(FAILURE))
    out = run_cli("--follow", str(path))
    assert out.code == 2 and b"compressed" in out.stderr
