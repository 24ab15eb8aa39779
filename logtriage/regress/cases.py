"""Regression cases: captured logs with `*.expect.toml` sidecars, and how a report compares."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Mapping

from logtriage.errors import InputError

EXPECT_SUFFIX = ".expect.toml"
CONSOLE_SUFFIX = ".console.log"   # a folder case's console, kept beside it
_LOG_SUFFIXES = (".log", ".log.gz", ".txt", ".out", "")


class Outcome(str, Enum):
    PASS = "pass"
    FAIL = "fail"
    KNOWN_MISS = "known"   # fails, as its expectation says it will (`known_miss = "why"`)
    ERROR = "error"


@dataclass(frozen=True)
class Expectation:
    verdict: str = "failed"
    category: str | None = None
    rule: str | None = None
    rank: int | None = None
    ranks: tuple[int, ...] | None = None
    exception_type: str | None = None
    required_findings: tuple[str, ...] = ()
    forbidden_findings: tuple[str, ...] = ()
    note: str = ""
    known_miss: str = ""          # why triage cannot get this one (the cause is not in the excerpt)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Expectation":
        ranks = data.get("ranks")
        return cls(
            verdict=str(data.get("verdict", "failed")),
            category=data.get("category") or None,
            rule=data.get("rule") or None,
            rank=data.get("rank") if isinstance(data.get("rank"), int) else None,
            ranks=tuple(ranks) if isinstance(ranks, list) else None,
            exception_type=data.get("exception_type") or None,
            required_findings=tuple(data.get("required_findings", ())),
            forbidden_findings=tuple(data.get("forbidden_findings", ())),
            note=str(data.get("note", "")),
            known_miss=str(data.get("known_miss", "")),
        )


@dataclass(frozen=True)
class Case:
    name: str
    log: Path
    expect_path: Path
    expectation: Expectation
    console: Path | None = None   # a `--log-dir` folder's console beside it (`X.console.log`)

    @property
    def inputs(self) -> tuple[Path, ...]:
        """What triage reads for this case: the log, and a folder's console where one was kept
        (with `--redirects` the agent's exit codes and signals are only there)."""
        return (self.log,) if self.console is None else (self.log, self.console)


@dataclass(frozen=True)
class CaseResult:
    case: Case
    outcome: Outcome
    problems: tuple[str, ...] = ()
    got: Mapping[str, Any] = field(default_factory=dict)
    rule_hits: Mapping[str, int] = field(default_factory=dict)


def find_cases(root: Path) -> list[Case]:
    """Every `X.expect.toml` under root with its log (`X.log`, `X.log.gz`, or a folder `X/`, then
    with its console `X.console.log` where one lies beside the folder)."""
    if root.is_file() and root.name.endswith(EXPECT_SUFFIX):
        paths = [root]
    elif root.is_file() and _expectation_of(root).is_file():   # a captured log: its sidecar
        paths = [_expectation_of(root)]
    elif root.is_dir():
        paths = sorted(root.rglob(f"*{EXPECT_SUFFIX}"))
    else:
        raise InputError(f"{root}: not a folder of captured logs, an .expect.toml file or a log with one beside it")
    cases = []
    for expect in paths:
        stem = expect.name[: -len(EXPECT_SUFFIX)]
        log = next((expect.with_name(stem + s) for s in _LOG_SUFFIXES if expect.with_name(stem + s).exists()), None)
        if log is None:
            continue
        try:
            data = tomllib.loads(expect.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise InputError(f"{expect}: cannot read expectation ({exc})") from None
        console = expect.with_name(stem + CONSOLE_SUFFIX)
        cases.append(Case(str(expect.relative_to(root) if root.is_dir() else expect.name)[: -len(EXPECT_SUFFIX)],
                          log, expect, Expectation.from_dict(data),
                          console if log.is_dir() and console.is_file() else None))
    return cases


def compare(expect: Expectation, report: Mapping[str, Any]) -> list[str]:
    """What in the report disagrees with the expectation (empty = pass)."""
    problems = []
    rc = report.get("root_cause") or {}
    if report.get("verdict") != expect.verdict:
        problems.append(f"verdict {report.get('verdict')!r}, expected {expect.verdict!r}")
    if expect.verdict == "ok":
        if expect.category is None and expect.rule is None and expect.rank is None:
            return problems
        rc = report.get("recovered") or {}   # an ok run that recovered from a failure: that failure
    checks = (("category", expect.category, rc.get("category")), ("rule", expect.rule, rc.get("rule_id")),
              ("rank", expect.rank, rc.get("rank")), ("exception_type", expect.exception_type, rc.get("exception_type")))
    for name, want, got in checks:
        if name == "exception_type" and want is not None and got is not None:
            want, got = short_name(want), short_name(got)
        if want is not None and want != got:
            problems.append(f"{name} {got!r}, expected {want!r}")
    if expect.ranks is not None and sorted(expect.ranks) != sorted(rc.get("ranks") or []):
        problems.append(f"ranks {rc.get('ranks')}, expected {list(expect.ranks)}")
    found = {f["rule_id"] for f in report.get("findings", [])}
    problems += [f"required finding {r} missing" for r in expect.required_findings if r not in found]
    problems += [f"forbidden finding {r} present" for r in expect.forbidden_findings if r in found]
    return problems


def _expectation_of(log: Path) -> Path:
    """`X.log` or `X.log.gz` -> `X.expect.toml` beside it."""
    name = log.name.removesuffix(".gz").removesuffix(".log")
    return log.with_name(name + EXPECT_SUFFIX)


def short_name(exception_type: str) -> str:
    """An exception's class name without its module or namespace (`torch.distributed.checkpoint.api.X`, a C++
    `gloo::EnforceNotMet`): a label may name either form."""
    return re.split(r"\.|::", exception_type)[-1]
