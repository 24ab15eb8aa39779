"""The bad-input matrix of docs/hostile-input.md, one test (or a few) per row. Every case also
checks line conservation: each physical line in exactly one stream, at its own line number."""

from __future__ import annotations

import errno
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from logtriage.api import run_triage
from logtriage.demux.clean import clean, decode
from logtriage.ingest.reader import MAX_LINE, TAIL, iter_raw_lines
from logtriage.ingest.sources import Source
from tests.conftest import SAMPLES
from tests.fuzz.cli import ROOT, Outcome, assert_clean_exit, environment, run_cli
from tests.fuzz.invariants import check_conservation, check_outputs

RANK_EXCEPTION = SAMPLES / "cpu" / "rank_exception__np4.log"   # rank 2 KeyError, the others cascade
HEALTHY = SAMPLES / "cpu" / "healthy__np4.log"


def triage_file(path: Path):
    run = run_triage([str(path)])
    check_conservation(run, [path])
    check_outputs(run)
    return run, run.report.to_dict()


def write(tmp_path: Path, data: bytes, name: str = "case.log") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


# -- empty, whitespace, binary ------------------------------------------------------------------

def test_empty_file(tmp_path):
    run, report = triage_file(write(tmp_path, b""))
    assert (report["verdict"], report["input_lines"], report["streams"], report["root_cause"]) == ("ok", 0, [], None)
    out = run_cli(str(tmp_path / "case.log"))
    assert out.code == 0 and out.stdout.startswith(b"triage: OK") and out.stderr == b""


def test_only_whitespace(tmp_path):
    run, report = triage_file(write(tmp_path, b"   \n\t\n\n  \r\n \x0c \x0b\n   "))
    assert report["verdict"] == "ok" and report["input_lines"] == 6 and report["findings"] == []


def test_binary_with_nul_bytes(tmp_path):
    data = b"\x00" * 4096 + b"\n" + bytes(range(256)) * 64 + b"\n[rank0]: \x00Runtime\x00Error: bo\x00om\n\x7fELF\x02\x01\x01"
    run, report = triage_file(write(tmp_path, data))
    assert report["root_cause"]["rank"] == 0
    assert report["root_cause"]["text"] == "RuntimeError: boom"   # NULs inside a message are dropped
    assert report["input_lines"] == data.count(b"\n") + 1


def test_core_dump_sized_binary_is_quick(tmp_path):
    data = random.Random(0).randbytes(8 << 20)
    started = time.monotonic()
    run, report = triage_file(write(tmp_path, data))
    assert time.monotonic() - started < 30
    assert (report["verdict"], report["findings"]) == ("ok", [])   # noise is no failure
    assert report["input_lines"] == data.count(b"\n") + (not data.endswith(b"\n"))


# -- encodings ----------------------------------------------------------------------------------

def test_invalid_utf8_and_latin1_keep_every_character(tmp_path):
    data = ("[rank1]: Traceback (most recent call last):\n[rank1]:   File \"x.py\", line 1, in <module>\n"
            "[rank1]: KeyError: 'caf\xe9'\n").encode("latin-1") + "[rank0]: stage ü ok\n".encode()
    run, report = triage_file(write(tmp_path, data))
    assert report["root_cause"]["text"] == "KeyError: 'café'"
    assert report["root_cause"]["rank"] == 1 and report["root_cause"]["line"] == 3


def test_mixed_utf8_and_latin1_in_one_line():
    assert decode("grün ".encode() + b"gr\xfcn \xed\xa0\x80 \xff") == "grün grün í\xa0\x80 ÿ"
    assert decode(b"\xff" * 10_000) == "\xff" * 10_000           # long and binary: Latin-1 at once
    assert decode("ok ✓".encode()) == "ok ✓"


@pytest.mark.parametrize("codec, bom", [("utf-16-le", "\ufeff"), ("utf-16-be", "\ufeff"), ("utf-16-le", "")])
def test_a_utf16_log_reads_like_its_utf8_text(tmp_path, codec, bom):
    # PowerShell's `>` and Notepad's "Unicode" write UTF-16 (with a byte-order mark); read as bytes
    # it was a run with no error at all
    text = RANK_EXCEPTION.read_text(encoding="utf-8")
    _, want = triage_file(write(tmp_path, text.encode(), "utf8.log"))
    _, got = triage_file(write(tmp_path, (bom + text).encode(codec), "utf16.log"))
    key = ("rule_id", "rank", "line", "text", "exception_type")
    assert [got["root_cause"][k] for k in key] == [want["root_cause"][k] for k in key]
    assert got["input_lines"] == want["input_lines"]
    piped = subprocess.run([sys.executable, "-m", "logtriage", "-", "--format", "json"], cwd=ROOT,
                           input=(bom + text).encode(codec), capture_output=True, env=environment())
    assert piped.returncode == 0
    assert json.loads(piped.stdout)["root_cause"]["line"] == want["root_cause"]["line"]


def test_unicode_blanks_and_typographic_quotes_read_as_ascii():
    # a traceback copied from a web page: no-break spaces, a zero-width space, curly quotes
    assert clean("\ufeff[rank1]:\xa0 File \u201ctrain.py\u201d, line\u202f3") == '[rank1]:  File "train.py", line 3'
    assert clean("KeyError:\u00a0\u2018target\u2019\u200b") == "KeyError: 'target'"


# -- line ends: CRLF, lone CR (tqdm) --------------------------------------------------------------

def test_crlf_log_reads_like_the_lf_log(tmp_path):
    lf = RANK_EXCEPTION.read_bytes()
    crlf = lf.replace(b"\n", b"\r\n")
    _, a = triage_file(write(tmp_path, lf, "lf.log"))
    _, b = triage_file(write(tmp_path, crlf, "crlf.log"))
    key = ("rule_id", "rank", "line", "text", "exception_type")
    assert [a["root_cause"][k] for k in key] == [b["root_cause"][k] for k in key]
    assert a["input_lines"] == b["input_lines"]


def test_tqdm_redraws_keep_the_last_state_and_the_error_after_them(tmp_path):
    bar = "".join(f"\r{p:3d}%|{'#' * (p // 10):<10}| {p}/100 [00:0{p // 50}<00:01, 90.1it/s]" for p in range(0, 60, 5))
    data = (f"[rank0]: step 1 loss 0.1\n[rank1]: {bar}\r[rank1]: Traceback (most recent call last):\n"
            f"[rank1]:   File \"t.py\", line 1, in <module>\n[rank1]: ValueError: bad batch{bar}\n").encode()
    run, report = triage_file(write(tmp_path, data))
    assert report["root_cause"]["rank"] == 1
    assert report["root_cause"]["exception_type"] == "ValueError"
    assert clean("a\rb\rc") == "c" and clean("step 3\r\n") == "step 3" and clean("\r\r") == ""


def test_a_record_glued_after_a_labelled_bar_keeps_its_label():
    # pdsh's label, then tqdm's redraws, then a logging record written without a newline between
    # (sample_logs/cpu_adhoc/logerr_osexit_np8_r0_pdsh2, line 66)
    line = ("worker-0: \rrank 0 train:   0%|          | 0/6 [00:00<?, ?it/s]\rrank 0 train:  33%|###       | "
            "2/6 [00:00<00:00,  4.29it/s]2026-12-02 11:56:04,758 - trainer - ERROR - [rank 0] step failed: 'y'")
    assert clean(line) == "worker-0: 2026-12-02 11:56:04,758 - trainer - ERROR - [rank 0] step failed: 'y'"
    assert clean("worker-0: \r 17%|#  | 1/6 [00:00<00:01,  4.1it/s]\r 33%|## | 2/6 [00:00<00:00,  4.2it/s]") \
        == "worker-0:  33%|## | 2/6 [00:00<00:00,  4.2it/s]"


def test_lone_cr_line_ends_make_one_physical_line(tmp_path):
    """Old-Mac line ends: a line is what ends in \\n, so the whole file is one line whose last
    redraw state is what rules see (documented limit)."""
    run, report = triage_file(write(tmp_path, b"[rank0]: step 1\r[rank0]: step 2\r[rank0]: KeyError: 'k'\r"))
    assert report["input_lines"] == 1
    assert report["root_cause"]["text"] == "KeyError: 'k'"


# -- a 100 MB line ------------------------------------------------------------------------------

def test_overlong_line_is_bounded_and_offsets_stay_exact():
    head = b"[rank1]: " + b"x" * (MAX_LINE + 5000)
    data = b"[rank0]: step 1\n" + head + b"TAILEND\n[rank1]: KeyError: 1\nno newline"
    tee = io.BytesIO()
    source = Source(0, "mem", None)
    lines = list(_iter_bytes(data, source, tee))
    assert [o for o, _ in lines] == [0, 16, 16 + len(head) + 8, 16 + len(head) + 8 + 21]
    assert len(lines[1][1]) <= MAX_LINE + TAIL + 16
    assert lines[1][1].startswith(b"[rank1]: xxx") and lines[1][1].endswith(b"TAILEND")
    assert lines[2][1] == b"[rank1]: KeyError: 1" and lines[3][1] == b"no newline"
    assert tee.getvalue() == data                        # stdin's spool is byte-exact


# runs argv[2:] and writes that process's own peak RSS (KiB) to argv[1]; exits with its code
_PEAK_WRAPPER = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[2:]); "
                 "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
                 "sys.exit(code)")


def test_hundred_megabyte_line(tmp_path):
    path = tmp_path / "huge_line.log"
    with path.open("wb") as out:
        out.write(b"[rank0]: step 1 loss 0.1\n[rank1]: {")
        chunk = b'"k": [1, 2, 3], ' * 4096
        for _ in range((100 << 20) // len(chunk)):
            out.write(chunk)
        out.write(b"}\n[rank1]: Traceback (most recent call last):\n[rank1]: RuntimeError: boom\n")
    # The peak is read by a small wrapper process: a child's ru_maxrss starts at its parent's size
    # (the pages it had when it was forked), so measured from pytest, late in a long session, it
    # would report pytest's own memory rather than triage's.
    peak_file = tmp_path / "peak_kb"
    started = time.monotonic()
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        proc = subprocess.run([sys.executable, "-c", _PEAK_WRAPPER, str(peak_file),
                               sys.executable, "-m", "logtriage", str(path), "--format", "json"],
                              stdout=stdout, stderr=stderr, env=environment(), cwd=ROOT, check=False)
        elapsed = time.monotonic() - started
        stdout.seek(0)
        stderr.seek(0)
        out = Outcome(proc.returncode, stdout.read(), stderr.read())
    peak_mb = int(peak_file.read_text()) / 1024
    assert_clean_exit(out)
    assert out.code == 0 and b'"input_lines": 4' in out.stdout and b'"rank": 1' in out.stdout
    assert elapsed < 60, elapsed
    assert peak_mb < 1500, peak_mb


def _iter_bytes(data: bytes, source: Source, tee):
    import logtriage.ingest.reader as reader
    original = reader.open_source

    class _Stream:
        def __enter__(self):
            return io.BufferedReader(io.BytesIO(data))

        def __exit__(self, *exc):
            return False

    reader.open_source = lambda _source: _Stream()
    try:
        yield from iter_raw_lines(source, tee=tee)
    finally:
        reader.open_source = original


# -- folders: unreadable files, empty per-rank files, symlink loops -------------------------------

def test_folder_with_empty_unreadable_and_looping_files(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.log").write_text("")                                   # empty per-rank file
    (logs / "rank1.log").write_text("Traceback (most recent call last):\nKeyError: 'shard'\n")
    (logs / "rank2.log").write_text("step 1 loss 0.1\n")
    (logs / "rank3.log").symlink_to("nowhere")                           # dangling
    (logs / "loop").symlink_to("loop")                                   # ELOOP
    (logs / "up").symlink_to(".")                                        # a directory loop
    (logs / "sub").mkdir()
    (logs / "sub" / "back").symlink_to("..")
    run, report = triage_folder(logs)
    assert report["root_cause"]["rank"] == 1 and report["root_cause"]["exception_type"] == "KeyError"
    assert {r["rank"] for r in report["ranks"]} == {1, 2}
    skipped = " ".join(report["problems"])
    assert "loop" in skipped and "rank3.log" in skipped
    assert len(report["sources"]) == 3


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux /proc")
def test_folder_with_a_file_that_fails_to_read_even_as_root(tmp_path):
    """chmod 000 does not stop root (CI runs as root); /proc/self/mem opens but every read at
    offset 0 fails with EIO, which is what a bad disk does."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.log").symlink_to("/proc/self/mem")
    (logs / "rank1.log").write_text("[rank1]: KeyError: 1\n")
    run = run_triage([str(logs)])
    assert run.report.root_cause.rank == 1
    assert len(run.scan.unreadable) == 1 and "cannot read" in run.scan.unreadable[0]
    out = run_cli(str(logs))
    assert_clean_exit(out)
    assert out.code == 3 and out.stdout.startswith(b"triage: FAILED")
    assert b"warning:" in out.stderr and b"rank0.log" in out.stderr


def test_folder_with_a_chmod_000_file(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    logs.mkdir()
    secret = logs / "rank0.log"
    secret.write_text("[rank0]: KeyError: 0\n")
    secret.chmod(0)
    if os.geteuid() == 0:
        # root reads a chmod 000 file anyway (CI runs as root): the OS answers as it does to anyone else
        from logtriage.ingest import reader

        def refusing(file, *args, **kwargs):
            if Path(file) == secret:
                raise PermissionError(errno.EACCES, "Permission denied", str(file))
            return open(file, *args, **kwargs)

        monkeypatch.setattr(reader, "open", refusing, raising=False)
    (logs / "rank1.log").write_text("[rank1]: KeyError: 1\n")
    try:
        run = run_triage([str(logs)])
        assert run.report.root_cause.rank == 1
        assert any("permission denied" in p.lower() for p in run.report.problems)
    finally:
        secret.chmod(0o644)


def test_named_file_nothing_can_be_read_from(tmp_path):
    if not Path("/proc/self/mem").exists():
        pytest.skip("needs Linux /proc")
    out = run_cli("/proc/self/mem")
    assert_clean_exit(out)
    assert out.code == 3 and out.stdout == b"" and b"cannot read" in out.stderr


def triage_folder(folder: Path):
    run = run_triage([str(folder)])
    files = [Path(str(s.path)) for s in run.scan.sources]
    check_conservation(run, files)
    check_outputs(run)
    return run, run.report.to_dict()


# -- prefixes: only a prefix, garbled ones ------------------------------------------------------

def test_lines_of_only_a_rank_prefix(tmp_path):
    data = b"[rank1]:\n[rank1]: \n[default0]:\n[1,3]<stdout>:\n[rank2]:[rank2]:\n"
    run, report = triage_file(write(tmp_path, data))
    assert report["verdict"] == "ok"
    assert {r["rank"]: r["lines"] for r in report["ranks"]} == {0: 1, 1: 2, 2: 1, 3: 1}


def test_garbled_prefixes(tmp_path):
    data = (b"[rank1]: [rank\n[rank1]: [rank1]: [rank\n[rank[rank1]: x\n[rank\n]: [\n[rank1\n"
            b"[rank1]: Traceback (most recent call last):\n[rank1]: [rank\n[rank1]: KeyError: 'x'\n")
    run, report = triage_file(write(tmp_path, data))
    assert report["root_cause"]["rank"] == 1
    assert report["root_cause"]["text"] == "KeyError: 'x'"


def test_glued_lines_of_two_ranks_are_split_and_counted_once(tmp_path):
    data = b"[rank0]: step 1 loss 0.18[rank1]: step 1 loss 0.07\n[rank1]: KeyError: 'a'[rank0]: step 2\n"
    run, report = triage_file(write(tmp_path, data))
    assert run.scan.fragments == 2
    assert report["root_cause"]["rank"] == 1
    assert report["input_lines"] == 2


# -- no failure at all --------------------------------------------------------------------------

def test_a_healthy_log_is_ok_not_a_false_alarm(tmp_path):
    run, report = triage_file(HEALTHY)
    assert report["verdict"] == "ok" and report["root_cause"] is None and report["chain"] == []
    assert all(f["role"] in ("context", "cause_confirmation") or f["category"] == "performance_validity"
               for f in report["findings"]), report["findings"]
    out = run_cli(str(HEALTHY))
    assert out.code == 0 and out.stdout.startswith(b"triage: OK")
