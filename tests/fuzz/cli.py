"""Run `triage` as a user does, in a subprocess, and check what a user would see."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Exit codes `triage LOG` may end with (cli.EXIT_CODES): report, bad usage, unreadable input,
# malformed catalog (--strict-catalog), interrupted.
ANALYZE_EXIT_CODES = frozenset({0, 2, 3, 4, 130})


@dataclass(frozen=True)
class Outcome:
    code: int
    stdout: bytes
    stderr: bytes


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LOGTRIAGE_PATTERNS", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("NO_COLOR", None)
    return env


def run_cli(*args: str, stdin: bytes | None = None, timeout: float = 60) -> Outcome:
    proc = subprocess.run([sys.executable, "-m", "logtriage", *args], input=stdin, capture_output=True,
                          timeout=timeout, env=environment(), cwd=ROOT)
    return Outcome(proc.returncode, proc.stdout, proc.stderr)


def assert_clean_exit(outcome: Outcome) -> None:
    """A documented exit code, no traceback, at most a few one-line messages on stderr."""
    assert outcome.code in ANALYZE_EXIT_CODES, (outcome.code, outcome.stderr[-2000:])
    assert b"Traceback (most recent call last)" not in outcome.stderr, outcome.stderr[-2000:]
    for line in outcome.stderr.decode("utf-8", "replace").splitlines():
        assert line.startswith("triage: "), line
