"""Property test of the `triage` command itself, in a subprocess: for generated log-like bytes,
from a file or from standard input, in every format, it exits with a documented code, prints no
traceback, keeps control bytes off the terminal and emits JSON that parses and conserves lines."""

from __future__ import annotations

import itertools
import json
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.budget import TRIED, fuzz_settings, report_tried
from tests.fuzz.cli import assert_clean_exit, run_cli
from tests.fuzz.invariants import RAW_TERMINAL_UNSAFE
from tests.fuzz.strategies import log_bytes, physical_lines

_COUNTER = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def _tried(request):
    yield
    report_tried(request, "cli.")


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="logtriage-fuzz-cli-") as name:
        yield Path(name)


@fuzz_settings(24)
@given(data=log_bytes(), fmt=st.sampled_from(["text", "md", "json"]), via_stdin=st.booleans(),
       color=st.sampled_from(["never", "always"]))
def test_triage_command_on_any_log(workdir, data, fmt, via_stdin, color):
    TRIED["cli.analyze"] += 1
    if via_stdin:
        out = run_cli("-", "--format", fmt, "--color", color, stdin=data)
    else:
        path = workdir / f"fuzz{next(_COUNTER)}.log"
        path.write_bytes(data)
        out = run_cli(str(path), "--format", fmt, "--color", color)
    assert_clean_exit(out)
    gzip_magic = data[:2] == b"\x1f\x8b"
    assert out.code == 0 or (gzip_magic and out.code == 3), (out.code, out.stderr)
    if out.code != 0:
        return
    if fmt == "json":
        report = json.loads(out.stdout)
        if not gzip_magic:
            assert report["input_lines"] == len(physical_lines(data))
        assert report["input_lines"] == sum(s["lines"] for s in report["streams"])
    else:
        shown = out.stdout
        if color == "always" and fmt == "text":
            shown = re.sub(rb"\x1b\[[0-9;]*m", b"", shown)
        bad = RAW_TERMINAL_UNSAFE.search(shown)
        assert bad is None, shown[max(0, bad.start() - 60): bad.end() + 60]
