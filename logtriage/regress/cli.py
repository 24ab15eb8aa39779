"""Regression-test the catalog against captured logs.

    triage test sample_logs/                 every log with an X.expect.toml beside it
    triage test sample_logs/cpu --junit report.xml

Prints a table of passes and failures, each rule's hit count across the corpus, rules that never
fired, and findings no expectation asked for. Exits 1 if any case fails.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from xml.etree import ElementTree as ET

from logtriage.api import TriageOptions
from logtriage.regress.cases import Outcome
from logtriage.regress.runner import Summary, run_all


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", type=Path, help="a folder of logs with .expect.toml sidecars")
    parser.add_argument("--patterns", action="append", default=[], metavar="DIR")
    parser.add_argument("--junit", type=Path, metavar="FILE", help="also write a JUnit XML report")
    parser.add_argument("--quiet", action="store_true", help="only failures and the totals")


def run(args: argparse.Namespace) -> int:
    summary = run_all(args.folder, TriageOptions(patterns_dirs=tuple(args.patterns)))
    print(format_summary(summary, quiet=args.quiet))
    if args.junit:
        write_junit(summary, args.junit)
    return 1 if summary.failed else 0


def format_summary(summary: Summary, quiet: bool = False) -> str:
    lines = [f"{'case':<58} {'result':<6} got"]
    for r in summary.results:
        if quiet and r.outcome is Outcome.PASS:
            continue
        got = r.got
        what = f"{got.get('verdict')} {got.get('category')} {got.get('rule')} rank={got.get('rank')}" if got else ""
        lines.append(f"{r.case.name[:58]:<58} {r.outcome.value:<6} {what}")
        lines += [f"    - {p}" for p in r.problems]
        if r.outcome is Outcome.KNOWN_MISS:
            lines.append(f"    (known miss: {r.case.expectation.known_miss})")
    total = len(summary.results)
    known = f", {summary.known_misses} known miss(es)" if summary.known_misses else ""
    lines.append(f"\n{total - summary.failed - summary.known_misses}/{total} passed{known}")
    if not quiet:
        lines.append("\nrule hits (logs in which each rule fired):")
        lines += [f"  {rule:<36} {n}" for rule, n in sorted(summary.rule_hits.items(), key=lambda kv: (-kv[1], kv[0]))]
        lines.append(f"\nrules that never fired ({len(summary.silent_rules)}): " + ", ".join(summary.silent_rules))
        extra = ", ".join(f"{k} ({v})" for k, v in sorted(summary.unexpected.items(), key=lambda kv: -kv[1]))
        lines.append(f"\nfindings no expectation asked for (logs): {extra}")
    return "\n".join(lines)


def write_junit(summary: Summary, path: Path) -> None:
    suite = ET.Element("testsuite", name="triage", tests=str(len(summary.results)),
                       failures=str(sum(r.outcome is Outcome.FAIL for r in summary.results)),
                       errors=str(sum(r.outcome is Outcome.ERROR for r in summary.results)))
    for r in summary.results:
        case = ET.SubElement(suite, "testcase", classname="triage.samples", name=r.case.name)
        if r.outcome is Outcome.KNOWN_MISS:
            ET.SubElement(case, "skipped", message=r.case.expectation.known_miss)
        elif r.outcome is not Outcome.PASS:
            tag = "failure" if r.outcome is Outcome.FAIL else "error"
            ET.SubElement(case, tag, message="; ".join(r.problems)).text = "\n".join(r.problems)
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)
