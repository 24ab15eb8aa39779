"""Run every case, compare, and summarise: passes, failures, rule hit counts, silent rules."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from logtriage.api import TriageOptions, get_catalog, triage
from logtriage.errors import TriageError
from logtriage.regress.cases import Case, CaseResult, Outcome, compare, find_cases


@dataclass(frozen=True)
class Summary:
    results: tuple[CaseResult, ...]
    rule_hits: dict[str, int]          # rule id -> number of logs in which it fired
    silent_rules: tuple[str, ...]      # catalog rules that fired in no log
    unexpected: dict[str, int]         # finding rule ids no expectation asked for -> logs

    @property
    def failed(self) -> int:
        return sum(1 for r in self.results if r.outcome in (Outcome.FAIL, Outcome.ERROR))

    @property
    def known_misses(self) -> int:
        return sum(1 for r in self.results if r.outcome is Outcome.KNOWN_MISS)


def run_case(case: Case, options: TriageOptions) -> CaseResult:
    try:
        report = triage([str(path) for path in case.inputs], options).to_dict()
    except TriageError as exc:
        return CaseResult(case, Outcome.ERROR, (f"triage failed: {exc}",))
    problems = compare(case.expectation, report)
    hits = Counter(f["rule_id"] for f in report["findings"])
    rc = report.get("root_cause") or {}
    got = {"verdict": report["verdict"], "category": rc.get("category"), "rule": rc.get("rule_id"),
           "rank": rc.get("rank"), "ranks": rc.get("ranks")}
    outcome = Outcome.PASS if not problems else (Outcome.KNOWN_MISS if case.expectation.known_miss else Outcome.FAIL)
    return CaseResult(case, outcome, tuple(problems), got, dict(hits))


def run_all(root: Path, options: TriageOptions = TriageOptions()) -> Summary:
    results = tuple(run_case(case, options) for case in find_cases(root))
    hits: Counter = Counter()
    unexpected: Counter = Counter()
    for result in results:
        expect = result.case.expectation
        asked = {expect.rule, *expect.required_findings}
        for rule_id in result.rule_hits:
            hits[rule_id] += 1
            if rule_id not in asked:
                unexpected[rule_id] += 1
    catalog = get_catalog(options.patterns_dirs)
    silent = tuple(sorted(c.rule.id for c in catalog.rules if c.rule.id not in hits and not c.rule.derived))
    return Summary(results, dict(hits), silent, dict(unexpected))
