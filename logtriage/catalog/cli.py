"""List, check or export the error catalog.

    triage catalog list [--format text|json]     every rule: id, category, role, title
    triage catalog check                          ids unique, fields present, patterns compile,
                                                  every example matches, no counterexample does
    triage catalog grep-patterns                  the patterns as `grep -E -f` takes them

Add your own rules with --patterns DIR (repeatable) or LOGTRIAGE_PATTERNS=dir1:dir2.
"""

from __future__ import annotations

import argparse
import re
import sys

import orjson

from logtriage.catalog.check import check_catalog
from logtriage.catalog.loader import load_catalog


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("list", "check", "grep-patterns"))
    parser.add_argument("--patterns", action="append", default=[], metavar="DIR",
                        help="an extra rules directory (repeatable)")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--no-builtin", action="store_true", help="only the --patterns directories")


def run(args: argparse.Namespace) -> int:
    catalog = load_catalog(args.patterns, include_builtin=not args.no_builtin)
    if args.action == "check":
        problems = check_catalog(catalog)
        for problem in problems:
            print(problem)
        print(f"{len(catalog.rules)} rules, {len(problems)} problem(s)", file=sys.stderr)
        return 1 if problems else 0
    for problem in catalog.problems:
        print(f"triage: warning: {problem}", file=sys.stderr)
    rules = sorted((c.rule for c in catalog.rules), key=lambda r: r.id)
    if args.action == "grep-patterns":
        for rule in rules:
            for pattern in rule.patterns:
                converted = to_grep_ere(pattern)
                if converted is not None:
                    print(converted)
        return 0
    if args.format == "json":
        sys.stdout.write(orjson.dumps([r.describe() for r in rules], option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    for rule in rules:
        print(f"{rule.id:<34} {rule.category.value:<20} {rule.role.value:<18} {rule.title}")
    return 0


_GROUP = re.compile(r"\(\?(?:P<\w+>|:)")


def to_grep_ere(pattern: str) -> str | None:
    """Best-effort translation of an RE2 pattern to POSIX ERE with GNU extensions; None when the
    pattern uses something grep -E cannot express (inline flags, lazy quantifiers)."""
    if "(?i" in pattern or "(?s" in pattern or re.search(r"[*+?}]\?", pattern):
        return None
    out = _GROUP.sub("(", pattern)
    out = out.replace(r"\d", "[0-9]").replace(r"\D", "[^0-9]")
    out = re.sub(r"\[([^\]]*)\[0-9\]([^\]]*)\]", r"[\g<1>0-9\g<2>]", out)  # [\d.] -> [0-9.]
    return out
