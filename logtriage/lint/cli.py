"""Check training code and launch templates for known hang and crash patterns, before they run.

    triage lint train.py scripts/ jobs/            text: path:line:col: ID message
    triage lint src/ --format sarif -o lint.sarif  for code-scanning annotations on pull requests
    triage lint . --fail-on warning --ignore DDP107
    triage lint --list-rules                       the rules; `triage explain DDP101` shows one

Reads Python (parsed, never imported: torch is not needed), shell and Slurm scripts, and YAML job
templates. Exit 1 when a finding is at or above --fail-on (default: error). Silence one line with
`# triage: ignore[DDP101]` (or `# triage: ignore` for every rule), a whole file with
`# triage: ignore-file[LNC401]`.
"""

from __future__ import annotations

import argparse
import sys

import orjson

from logtriage.errors import InputError
from logtriage.lint.engine import lint_paths
from logtriage.lint.model import Severity
from logtriage.lint.registry import all_rules, select_rules
from logtriage.lint.render import problems_text, render


def _codes(values: list[str] | None) -> list[str]:
    return [c.strip() for v in values or [] for c in v.split(",") if c.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="*", metavar="PATH",
                        help="files or folders (default: the current folder)")
    parser.add_argument("--format", choices=("text", "json", "sarif"), default="text")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the report to FILE instead of stdout")
    parser.add_argument("--fail-on", choices=[s.value for s in Severity], default="error",
                        help="exit 1 when a finding has this severity or a higher one (default: error)")
    parser.add_argument("--select", action="append", metavar="CODES",
                        help="only these rules: ids, id prefixes (CKP, DDP1) or names, comma-separated")
    parser.add_argument("--ignore", action="append", metavar="CODES", help="skip these rules (same forms)")
    parser.add_argument("--list-rules", action="store_true", help="list the rules and exit")


def _list_rules(fmt: str) -> str:
    if fmt in ("json", "sarif"):
        return orjson.dumps([r.describe() for r in all_rules()], option=orjson.OPT_INDENT_2).decode() + "\n"
    rows = [f"{r.id:<7} {r.severity.value:<8} {r.kind.value:<9} {r.name:<34} {r.title}" for r in all_rules()]
    return "\n".join(rows) + "\n"


def _write(text: str, output: str | None) -> None:
    if output is None:
        sys.stdout.write(text)
        return
    try:
        with open(output, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as exc:
        raise InputError(f"{output}: cannot write: {exc.strerror}") from exc


def run(args: argparse.Namespace) -> int:
    if args.list_rules:
        _write(_list_rules(args.format), args.output)
        return 0
    rules = select_rules(_codes(args.select), _codes(args.ignore))
    result = lint_paths(args.paths or ["."], rules)
    _write(render(result, args.format), args.output)
    if result.problems:
        sys.stderr.write(problems_text(result))
    return 1 if result.at_or_above(Severity(args.fail_on)) else 0
