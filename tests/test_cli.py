"""The `triage` command: formats, the JSON contract, exit codes, clear errors for bad input."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from tests.conftest import SAMPLES

LOG = SAMPLES / "cpu" / "rank_exception__np4.log"


def triage(*args, stdin: bytes | None = None):
    return subprocess.run([sys.executable, "-m", "logtriage", *map(str, args)], input=stdin,
                          capture_output=True, timeout=120)


def test_json_follows_the_contract():
    out = triage(LOG, "--format", "json")
    assert out.returncode == 0
    report = json.loads(out.stdout)
    assert report["schema_version"] == 1 and report["verdict"] == "failed"
    rc = report["root_cause"]
    assert {"rule_id", "category", "title", "rank", "ranks", "line", "text", "exception_type",
            "confidence"} <= rc.keys()
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["exception_type"]) == \
        ("python.exception", "python_exception", 2, "KeyError")
    assert LOG.read_text().splitlines()[rc["line"] - 1].endswith("KeyError: 'target'")
    for link in report["chain"]:
        assert {"rule_id", "category", "role", "ranks", "line"} <= link.keys()
        assert link["role"] in ("initiating", "cascade", "teardown")
    for row in report["ranks"]:
        assert {"rank", "lines", "status", "first_error_line", "last_step"} <= row.keys()
        assert row["status"] in ("ok", "failed", "hung", "killed", "unknown")
    for finding in report["findings"]:
        assert {"rule_id", "category", "role", "rank", "line", "text", "captures"} <= finding.keys()
    assert report["input_lines"] == sum(s["lines"] for s in report["streams"])
    assert isinstance(report["environment"], dict) and isinstance(report["unattributed_lines"], int)


def test_text_and_markdown(tmp_path):
    text = triage(LOG, "--color", "never")
    assert text.returncode == 0 and b"rank 2: KeyError: 'target'" in text.stdout
    md = tmp_path / "r.md"
    assert triage(LOG, "--format", "md", "-o", md).returncode == 0
    body = md.read_text()
    assert body.startswith("## triage: failed") and "| rule | `python.exception` |" in body


def test_stdin_and_gzip(tmp_path):
    data = LOG.read_bytes()
    piped = json.loads(triage("-", "--format", "json", stdin=data).stdout)
    assert piped["root_cause"]["rank"] == 2 and piped["sources"] == ["<stdin>"]
    gz = tmp_path / "run.log.whatever"
    gz.write_bytes(gzip.compress(data))
    zipped = json.loads(triage(gz, "--format", "json").stdout)
    assert zipped["root_cause"]["line"] == piped["root_cause"]["line"]


@pytest.mark.parametrize("content", [b"", b"   \n\t\n", b"\x00\x01\x02binary\x00" * 1000,
                                     b"\xff\xfe invalid utf-8 \xc3\x28\n" * 100])
def test_odd_inputs_get_a_report_not_a_traceback(tmp_path, content):
    path = tmp_path / "odd.log"
    path.write_bytes(content)
    out = triage(path, "--format", "json")
    assert out.returncode == 0, out.stderr
    assert b"Traceback" not in out.stderr
    assert json.loads(out.stdout)["verdict"] == "ok"


def test_fifty_megabyte_line(tmp_path):
    path = tmp_path / "long.log"
    path.write_bytes(b"x" * (50 << 20) + b"\nKeyError: 'k'\n")
    out = triage(path, "--format", "json")
    assert out.returncode == 0 and b"Traceback" not in out.stderr
    assert json.loads(out.stdout)["input_lines"] == 2


def test_unreadable_input_is_one_line_and_exit_3(tmp_path):
    out = triage(tmp_path / "missing.log")
    assert out.returncode == 3
    assert out.stderr.decode().strip().count("\n") == 0 and "no such file" in out.stderr.decode()


def test_bad_usage_exit_2():
    assert triage(LOG, "--format", "yaml").returncode == 2
    assert triage("explain", "no.such.rule").returncode == 2


def test_help_documents_exit_codes_and_every_command():
    top = triage("--help").stdout.decode()
    for name in ("catalog", "explain", "test", "probe", "inject", "lint", "incident", "tui"):
        assert name in top
    analyze = triage("analyze", "--help").stdout.decode()
    assert "exit codes" in analyze and "130" in analyze


def test_explain_and_catalog():
    out = triage("explain", "E007", "--format", "json")
    assert out.returncode == 0 and json.loads(out.stdout)["id"] == "env.probe_json"
    assert triage("catalog", "check").returncode == 0
    listed = triage("catalog", "list").stdout.decode()
    assert "gloo.timeout" in listed and "cuda.oom" in listed


def test_triage_test_takes_a_captured_log_with_its_sidecar():
    out = triage("test", SAMPLES / "cpu" / "no_init__np2.log")
    assert out.returncode == 0
    assert b"pass   failed launch_usage dist.pg_not_initialized rank=1" in out.stdout
    out = triage("test", LOG.parent.parent.parent / "README.md")
    assert out.returncode == 3 and b"log with one beside it" in out.stderr


def test_thousands_of_ranks_of_alternating_kinds_share_a_row_per_kind():
    # docs/research/gaps44.md S4: 4,096 ranks whose teardown and timeout rows alternate made a
    # 2,780-line rank table; past 40 rows, every rank of a kind shares one row
    from logtriage.report.model import RankRow, Report
    from logtriage.report.text import render_text

    def row(rank: int) -> RankRow:
        if rank == 4093:
            return RankRow(rank, 0, "", 14, "failed", "root", 6844, "x.log", "KeyError: 'target'", 2, None)
        if rank % 3 == 0:
            return RankRow(rank, 0, "", 2, "killed", "teardown", None, None, None, 2, None)
        return RankRow(rank, 0, "", 20, "failed", "cascade", 8000 + rank, "x.log",
                       f"RuntimeError: Connection closed by peer [127.0.0.1]:{20000 + rank}", 2, None)
    report = Report(verdict="failed", root_cause=None, chain=(), findings=(), streams=(), input_lines=1,
                    unattributed_lines=0, sources=("x.log",), ranks=tuple(row(r) for r in range(4096)), environment={})
    table = render_text(report).split("Ranks\n", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert [line.split("  ")[1] for line in table] == [
        "ranks 0, 3, 6, 9, … (1,366 ranks) killed", "ranks 1–2, 4–5, 7–8, 10–11, … (2,729 ranks) failed", "rank 4093"]
    few = Report(verdict="failed", root_cause=None, chain=(), findings=(), streams=(), input_lines=1,
                 unattributed_lines=0, sources=("x.log",), ranks=tuple(row(r) for r in range(8)), environment={})
    assert "  ranks 1–2    failed" in render_text(few)   # few rows: consecutive ranks only, as before
