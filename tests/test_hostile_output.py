"""Output safety: a log (or a file name, or a user rule) never drives the terminal, never breaks
the JSON, never breaks a Markdown table or injects HTML. Checked on the raw bytes of stdout."""

from __future__ import annotations

import json
import os
import re

import orjson
import pytest

from logtriage.api import TriageOptions, run_triage
from logtriage.report import render
from logtriage.report.safe import markdown_code_span, terminal_safe_document
from tests.fuzz.cli import assert_clean_exit, run_cli
from tests.fuzz.invariants import TERMINAL_UNSAFE

HOSTILE = (
    b"[rank0]: step 1 loss 0.1\x1b]0;owned title\x07\n"
    b"[rank1]: \x1b[2J\x1b[H\x1b]8;;http://evil.example/\x1b\\click\x1b]8;;\x1b\\ step 1\n"
    b"[rank1]: Traceback (most recent call last):\n"
    b"[rank1]:   File \"train.py\", line 1, in <module>\x07\x07\n"
    b"[rank1]: KeyError: '<script>alert(1)</script> | `rm -rf` \xe2\x80\xae\xc2\x9b31m \x9b2J \x1b\x00 \xff\xfe'\n"
)
# The raw bytes a terminal acts on: ESC, BEL, C1 CSI/OSC/DCS/ST encoded as UTF-8, bidi overrides.
RAW_CONTROL = re.compile(rb"[\x00-\x08\x0b-\x1f\x7f]|\xc2[\x80-\x9f]|\xe2\x80[\xaa-\xae]|\xe2\x81[\xa6-\xa9]")
OWN_SGR = re.compile(rb"\x1b\[[0-9;]*m")


@pytest.fixture
def hostile_log(tmp_path):
    path = tmp_path / "hostile.log"
    path.write_bytes(HOSTILE)
    return path


@pytest.mark.parametrize("fmt", ["text", "md"])
def test_text_and_markdown_pass_no_control_bytes(hostile_log, fmt):
    out = run_cli(str(hostile_log), "--format", fmt, "--color", "never")
    assert_clean_exit(out)
    assert out.code == 0
    assert b"KeyError" in out.stdout
    bad = RAW_CONTROL.search(out.stdout)
    assert bad is None, out.stdout[max(0, bad.start() - 60): bad.end() + 60]


def test_colour_always_emits_only_our_sgr_codes(hostile_log):
    out = run_cli(str(hostile_log), "--color", "always")
    assert out.code == 0
    assert OWN_SGR.search(out.stdout), "colour was asked for"
    rest = OWN_SGR.sub(b"", out.stdout)
    bad = RAW_CONTROL.search(rest)
    assert bad is None, rest[max(0, bad.start() - 60): bad.end() + 60]


def test_hostile_file_name_in_text_markdown_and_json(tmp_path):
    """A file name is log-controlled too: ESC/BEL in it, and bytes that are not UTF-8."""
    folder = tmp_path / "logs"
    folder.mkdir()
    name = b"rank0_\xff\x1b]0;owned\x07.log"
    with open(os.path.join(os.fsencode(folder), name), "wb") as out:
        out.write(b"[rank0]: Traceback (most recent call last):\n[rank0]: KeyError: 1\n")
    for fmt in ("text", "md"):
        out = run_cli(str(folder), "--format", fmt)
        assert out.code == 0 and RAW_CONTROL.search(out.stdout) is None, out.stdout
        assert b"x1b" in out.stdout and b"owned" in out.stdout   # shown as a visible escape
    out = run_cli(str(folder), "--format", "json")
    assert_clean_exit(out)
    report = json.loads(out.stdout)
    assert report["root_cause"]["rank"] == 0
    assert report["sources"] == [f"{folder}/rank0_\\xff\x1b]0;owned\x07.log"]


def test_report_file_with_a_non_utf8_name_can_be_written(tmp_path):
    folder = tmp_path / "logs"
    folder.mkdir()
    with open(os.path.join(os.fsencode(folder), b"rank1_\xe9.log"), "wb") as out:
        out.write(b"[rank1]: KeyError: 1\n")
    target = tmp_path / "report.md"
    out = run_cli(str(folder), "--format", "md", "-o", str(target))
    assert out.code == 0, out.stderr
    assert "rank1\\_\\\\xe9.log" in target.read_text(encoding="utf-8")


def test_json_is_valid_for_every_kind_of_bad_byte(tmp_path):
    path = tmp_path / "bytes.log"
    path.write_bytes(HOSTILE + bytes(range(256)) + b"\n\xed\xa0\x80 surrogate as bytes \xf4\x90\x80\x80\n")
    run = run_triage([str(path)])
    text = render(run.report, "json")
    assert json.loads(text) == orjson.loads(text)
    assert json.loads(text)["input_lines"] == 8    # bytes(range(256)) holds a \n


def test_markdown_tables_keep_their_columns_and_carry_no_html(hostile_log, tmp_path):
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "evil.toml").write_text(
        'id = "user.evil|`x`<b>"\ntitle = "Evil <img src=x onerror=alert(1)> | title"\n'
        'category = "python_exception"\nrole = "root_candidate"\npriority = 99\n'
        "patterns = ['KeyError: .*script']\n")
    run = run_triage([str(hostile_log)], TriageOptions(patterns_dirs=(str(rules),)))
    assert run.report.root_cause.rule_id == "user.evil|`x`<b>"
    md = render(run.report, "md")
    assert not re.search(r"<(?:img|b|script)\b", _outside_code_blocks(md))
    for table in _tables(md):
        widths = {_cells(row) for row in table}
        assert len(widths) == 1, table


def test_code_span_survives_backticks_and_pipes():
    assert markdown_code_span("python.exception") == "`python.exception`"
    assert markdown_code_span("a`b") == "``a`b``"
    assert markdown_code_span("`x`") == "`` `x` ``"
    assert markdown_code_span("a|b") == "`a\\|b`"


def test_document_sanitiser_keeps_only_sgr():
    doc = "\x1b[1;31mtriage: FAILED\x1b[0m \x1b]0;t\x07 \x1b[2J \x9b1m"
    kept = terminal_safe_document(doc, keep_colour=True)
    assert kept.startswith("\x1b[1;31mtriage: FAILED\x1b[0m ")
    assert TERMINAL_UNSAFE.search(re.sub(r"\x1b\[[0-9;]*m", "", kept)) is None
    assert terminal_safe_document(doc).count("\x1b") == 0


def _outside_code_blocks(md: str) -> str:
    """Markdown that a renderer would parse for HTML: fenced blocks and code spans removed."""
    md = re.sub(r"^(`{3,})text\n.*?\n\1$", "", md, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"(?<![`\\])(`+)(?!`).*?(?<!`)\1(?!`)", "", md)


def _tables(md: str) -> list[list[str]]:
    tables, current = [], []
    for line in _outside_code_blocks(md).splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables + ([current] if current else [])


def _cells(row: str) -> int:
    """Columns as GFM counts them: pipes not escaped with a backslash."""
    return len(re.findall(r"(?<!\\)\|", row))
