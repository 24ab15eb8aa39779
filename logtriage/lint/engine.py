"""Run the lint rules over files and folders: discover, parse, check, silence, sort.

The linted code is parsed, never imported or run; torch is not needed.
"""

from __future__ import annotations

import ast
import os
from typing import Iterable, Iterator

from logtriage.errors import InputError
from logtriage.lint.ignores import python_suppressions, template_suppressions
from logtriage.lint.model import FileKind, Finding, LintResult, LintRule, Problem
from logtriage.lint.pyfile import PyFile
from logtriage.lint.registry import all_rules
from logtriage.lint.rules_templates import TemplateFile

PYTHON_SUFFIXES = (".py", ".pyi")
TEMPLATE_SUFFIXES = (".sh", ".bash", ".slurm", ".sbatch", ".yaml", ".yml", ".job", ".pbs")
SKIP_DIRS = frozenset({".git", ".hg", ".svn", ".venv", "venv", "node_modules", "__pycache__", ".tox", ".nox",
                       ".mypy_cache", ".pytest_cache", ".ruff_cache", "build", "dist", "site-packages", ".eggs"})
MAX_BYTES = 5 * 1024 * 1024


def classify(path: str) -> FileKind | None:
    lower = path.lower()
    if lower.endswith(PYTHON_SUFFIXES):
        return FileKind.PYTHON
    if lower.endswith(TEMPLATE_SUFFIXES):
        return FileKind.TEMPLATE
    if "." not in os.path.basename(path):
        try:
            with open(path, "rb") as handle:
                first = handle.readline(200)
        except OSError:
            return None
        if first.startswith(b"#!") and (b"sh" in first.split(b"/")[-1] or b"bash" in first):
            return FileKind.TEMPLATE
        if first.startswith(b"#!") and b"python" in first:
            return FileKind.PYTHON
    return None


def discover(paths: Iterable[str]) -> Iterator[tuple[str, FileKind]]:
    for path in paths:
        if os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
                for name in sorted(files):
                    full = os.path.join(root, name)
                    kind = classify(full)
                    if kind is not None:
                        yield full, kind
        elif os.path.isfile(path):
            kind = classify(path)
            if kind is not None:
                yield path, kind
        else:
            raise InputError(f"{path}: no such file or directory")


def _read(path: str) -> str:
    with open(path, "rb") as handle:
        data = handle.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise ValueError(f"larger than {MAX_BYTES // (1024 * 1024)} MiB, skipped")
    return data.decode("utf-8-sig")


def lint_text(path: str, text: str, kind: FileKind, rules: tuple[LintRule, ...]) -> tuple[list[Finding], list[Problem]]:
    """Lint one file's text with the rules of its kind."""
    active = [r for r in rules if r.kind is kind]
    if not active:
        return [], []
    problems: list[Problem] = []
    if kind is FileKind.PYTHON:
        try:
            subject: object = PyFile(path, text, ast.parse(text, filename=path))
        except SyntaxError as exc:
            return [], [Problem(path, exc.lineno or 0, f"cannot parse: {exc.msg}")]
        except (ValueError, RecursionError) as exc:
            return [], [Problem(path, 0, f"cannot parse: {exc}")]
        silenced = python_suppressions(text)
    else:
        subject = TemplateFile(path, text)
        silenced = template_suppressions(text)
    findings = []
    for rule in active:
        try:
            hits = list(rule.check(subject))
        except RecursionError as exc:   # pathological nesting; report instead of dying
            problems.append(Problem(path, 0, f"{rule.id} skipped: {exc}"))
            continue
        for hit in hits:
            finding = Finding(rule.id, rule.name, rule.severity, path, hit.line, hit.col, hit.message)
            if not silenced.silences(finding):
                findings.append(finding)
    return findings, problems


def lint_paths(paths: Iterable[str], rules: tuple[LintRule, ...] | None = None) -> LintResult:
    """Lint files and folders (Python, shell, Slurm, YAML) with `rules` (default: all)."""
    rules = all_rules() if rules is None else rules
    findings: list[Finding] = []
    problems: list[Problem] = []
    checked = 0
    for path, kind in discover(paths):
        try:
            text = _read(path)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            problems.append(Problem(path, 0, f"cannot read: {exc}"))
            continue
        checked += 1
        got, trouble = lint_text(path, text, kind, rules)
        findings += got
        problems += trouble
    unique = {(f.path, f.line, f.col, f.rule_id, f.message): f for f in findings}
    ordered = sorted(unique.values(), key=lambda f: (f.path, f.line, f.col, f.rule_id))
    return LintResult(tuple(ordered), tuple(problems), checked, tuple(rules))
