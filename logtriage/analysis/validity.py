"""A benchmark that refused its own result: its validity gate (another workload on the node, step
times that vary too much, a matrix its exclusive window could not hold; error manual E008/E009)
printed why, and the runner then exited non-zero, or raised an error of its own saying the same.
The gate's line is a warning (the numbers are not comparable; nothing broke), so the exit codes
or the runner's exception would otherwise be read as the failure: they are how the refusal ended
the job, and the gate's reason is the root."""

from __future__ import annotations

import re

from logtriage.analysis.findings import Finding
from logtriage.analysis.live_errors import EXIT_RULE
from logtriage.analysis.roots import RootCause, earliest
from logtriage.catalog.rule import Category, Role

# an exception a runner raises for a refused result (`BenchmarkInvalidError`, `ValidityError`)
_REFUSAL_TYPE = re.compile(r"(?i)invalid|validity")


def refused_result_first(root: RootCause, findings: list[Finding]) -> RootCause:
    finding = root.finding
    if finding is None:
        return root
    gates = [f for f in findings if f.category is Category.PERFORMANCE_VALIDITY and f.rule.role is Role.ROOT_CANDIDATE
             and not f.is_teardown and f.seq < finding.seq]
    if not gates:
        return root
    bare = root.rule.id == EXIT_RULE or root.rule.category is Category.UNKNOWN
    raised = (root.rule.category is Category.PYTHON_EXCEPTION and _REFUSAL_TYPE.search(finding.exception_type or "")
              is not None)
    if not (bare or raised):
        return root
    gate = earliest(gates)
    how = "its exit code" if bare else f"its `{finding.exception_type}`"
    rank = gate.rank
    exited = {f.rank for f in findings if f.rule.id == EXIT_RULE}
    if rank is None and len(exited) == 1 and None not in exited:
        rank = next(iter(exited))    # a gate line without a rank prefix, and the one rank that then exited non-zero
    return RootCause(gate.rule, gate, rank, (rank,) if rank is not None else (), 0.6, (
        f"the benchmark's validity check refused the result (line {gate.line}) before the job ended with {how}: "
        "the refusal is why it stopped; the run's code did not fail",))
