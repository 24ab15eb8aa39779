"""Secrets planted in a real captured log never reach a text, Markdown or JSON report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from logtriage.api import TriageOptions, triage
from logtriage.redact import Redactor, redact_report
from logtriage.report import render

ROOT = Path(__file__).resolve().parents[1]
BASE_LOG = ROOT / "sample_logs" / "cpu" / "rank_exception__np4.log"

# Fake credentials, assembled at run time.
SECRETS = {
    "hf": "hf_" + "Zq8XbW2mKpL4vN7rT1yC9dF3gH6jS0aQeU",
    "github": "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8",
    "aws_id": "AKIA" + "Q7RZ3KXW5T2YBN4M",
    "aws_secret": "wJalrXUtnFEMI/K7MDENG/" + "bPxRfiCY9x8Z7qLmNo",
    "openai": "sk-proj-" + "Tq3Vx9Lm2Np8Rs4Kw7Yz1Bc6Df0Gh5Jk",
    "password": "hunter2-Correct-Horse",
    "url_password": "s3cr3t-urlpass",
    "private_key": "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQDf8Yx2Lk3mN9pQ",
}


def planted_log(directory: Path, with_probe: bool = False) -> Path:
    """rank_exception__np4.log with secrets inside rank 2's root traceback and its exception line."""
    s = SECRETS
    lines = BASE_LOG.read_text(encoding="utf-8").splitlines(keepends=True)
    assert lines[23] == "[rank2]: KeyError: 'target'\n"        # the root-cause line of this capture
    frames = [
        f'[rank2]:   File "/tmp/job/fetch.py", line 9, in fetch  # AWS_ACCESS_KEY_ID={s["aws_id"]} '
        f'AWS_SECRET_ACCESS_KEY={s["aws_secret"]}\n',
        f'[rank2]:     requests.get("https://alice:{s["url_password"]}@data.corp.internal/shard", '
        f'headers={{"Authorization": "token {s["github"]}"}}, key="{s["openai"]}")\n',
        f'[rank2]:     login(password="{s["password"]}") # -----BEGIN PRIVATE KEY----- {s["private_key"]}\n',
    ]
    probe = [f'LOGTRIAGE_ENVIRONMENT_JSON={{"schema":1,"env":{{"HF_TOKEN":"{s["hf"]}","RANK":"2"}}}}\n'] \
        if with_probe else []
    out = probe + lines[:20] + frames + lines[20:23] + [f"[rank2]: KeyError: '{s['hf']}'\n"] + lines[24:]
    path = directory / "planted.log"
    path.write_text("".join(out), encoding="utf-8")
    return path


def leaked(text: str) -> list[str]:
    return [name for name, value in SECRETS.items() if value in text]


def test_unredacted_reports_do_carry_the_secrets(tmp_path):
    """The control: the planted lines reach every format, so the redaction test below means something."""
    report = triage([str(planted_log(tmp_path))], TriageOptions(redact=False))
    assert report.root_cause.rule_id == "python.exception" and report.root_cause.rank == 2
    for fmt in ("text", "md", "json"):
        assert sorted(leaked(render(report, fmt))) == sorted(SECRETS), fmt


@pytest.mark.parametrize("extra", [(), ("hosts", "paths", "ips")])
def test_redacted_reports_carry_none_of_them(tmp_path, extra):
    report = triage([str(planted_log(tmp_path))], TriageOptions(redact=True, redact_extra=extra))
    assert report.root_cause.rule_id == "python.exception" and report.root_cause.rank == 2
    assert report.root_cause.text == "KeyError: '[REDACTED:hf_token]'"
    for fmt in ("text", "md", "json"):
        text = render(report, fmt)
        assert leaked(text) == [], fmt
        for label in ("hf_token", "github_token", "aws_access_key", "aws_secret_key", "openai_key", "password",
                      "url_credentials", "private_key"):
            assert f"[REDACTED:{label}]" in text, (fmt, label)


def test_cli_markdown_attachment_is_redacted(tmp_path):
    log = planted_log(tmp_path)
    out_file = tmp_path / "incident.md"
    done = subprocess.run([sys.executable, "-m", "logtriage", str(log), "--format", "md", "-o", str(out_file)],
                          capture_output=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    text = out_file.read_text(encoding="utf-8")
    assert "`python.exception`" in text and leaked(text) == []


def test_redact_report_covers_environment_facts(tmp_path):
    raw = triage([str(planted_log(tmp_path, with_probe=True))], TriageOptions(redact=False))
    assert "hf" in leaked(render(raw, "json"))          # the probe's env reached the report
    clean = redact_report(raw, Redactor())
    for fmt in ("text", "md", "json"):
        assert leaked(render(clean, fmt)) == [], fmt


def test_triage_redacts_environment_facts(tmp_path):
    report = triage([str(planted_log(tmp_path, with_probe=True))], TriageOptions(redact=True))
    assert leaked(render(report, "json")) == []
