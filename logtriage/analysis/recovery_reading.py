"""A failure the run came back from: torchrun restarted the workers and they finished, the job was
started again and finished, the script caught the error and went on to a clean end, or every error is
one the program went on from. Such a failure is reported as recovered and the run as ok; a NaN the
last progress line still shows is no recovery (the run finished, training a broken model)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from logtriage.analysis.evidence import Evidence
from logtriage.analysis.findings import Finding
from logtriage.analysis.live_errors import went_on_from_every_error
from logtriage.analysis.recovered import caught_then_finished, relaunched_then_finished, restarted_then_finished
from logtriage.analysis.roots import RankFacts, RootCause, Verdict
from logtriage.analysis.stopped import FINISHED_RULE
from logtriage.catalog.rule import Category
from logtriage.demux.streams import StreamKind

__all__ = ["Recovery", "read_recovery"]

# a value printed as not finite (`loss nan`, `grad_norm=inf`, `'loss': -inf`)
_NON_FINITE = re.compile(r"(?i)(?<![\w.])[-+]?(?:nan|inf)(?![\w.])")
# a counter at its end (`8/8`, a tqdm bar's `100%|...| 8/8`): the line is the run's last step
_AT_THE_LAST_STEP = re.compile(r"(?<![\d/])(\d{1,9})/\1(?![\d/])")


@dataclass(frozen=True)
class Recovery:
    root: RootCause | None
    verdict: Verdict
    recovered: RootCause | None      # the failure the run came back from
    notes: tuple[str, ...] = ()


def read_recovery(ev: Evidence, root: RootCause | None, verdict: Verdict) -> Recovery:
    if verdict is not Verdict.FAILED or root is None:
        return Recovery(root, verdict, None)
    findings, failures, facts = ev.findings, ev.failures, ev.facts
    # a NaN the script printed and went on from is no recovery while a rank's last progress line
    # (or the last one no rank claims) still shows a non-finite value, or where the NaN itself is
    # printed at the last step: the run finished, training a broken model
    diverged = root.rule.category is Category.NUMERICAL and (any(
        _NON_FINITE.search(s.last_step_text) for k, s in ev.stream_stats.items()
        if k.kind in (StreamKind.RANK, StreamKind.UNATTRIBUTED)) or (
        root.finding is not None and _AT_THE_LAST_STEP.search(root.finding.text) is not None))
    finish = restarted_then_finished(root, findings, failures, {k.attempt for k in ev.keys})
    if finish is not None:
        return Recovery(None, Verdict.OK, root, (
            f"torchrun restarted the workers after the failure at line {root.finding.line} and the run then "
            f"finished (line {finish.line}): the job succeeded; that failure is reported as recovered",))
    again = relaunched_then_finished(root, findings, failures, ev.stream_stats)
    if again is not None:
        start, finish = again
        return Recovery(None, Verdict.OK, root, (
            f"torchrun was started again after the failure at line {root.finding.line} (its workers' lines from "
            f"line {start}), and that run finished (line {finish.line}) with no error: the job succeeded; that "
            f"failure is reported as recovered",))
    finish = None if diverged else caught_then_finished(
        root, findings, failures, {k.rank for k in ev.keys if k.kind is StreamKind.RANK and k.rank >= 0})
    if finish is not None:
        who = ("the agent then said its worker group succeeded" if finish.stream.kind is StreamKind.LAUNCHER
               else "every rank then said it finished")
        return Recovery(None, Verdict.OK, root, (
            f"the script caught the failure at line {root.finding.line} and went on: {who} (line {finish.line}) "
            f"and no worker exited with an error; that failure is reported as recovered (check what the run "
            f"skipped)",))
    if not failures and not diverged and _finished_after_every_error(findings, facts):
        return Recovery(None, Verdict.OK, None, (
            "every error in the log is one the program went on from (it said it retried, skipped or fell back, "
            "or every rank printed it and trained on), and the run then finished",))
    return Recovery(root, verdict, None)


def _finished_after_every_error(findings: list[Finding], facts: RankFacts) -> bool:
    """The log says the run finished after its last error, nothing of the launcher's says a worker
    failed, and every error is one the program went on from."""
    errors = [f for f in findings if f.is_error and not f.is_teardown]
    finishes = [f for f in findings if f.rule.id == FINISHED_RULE]
    if not errors or not finishes or max(f.seq for f in finishes) < max(f.seq for f in errors):
        return False
    if any(f.stream.kind is StreamKind.LAUNCHER for f in errors):
        return False
    return went_on_from_every_error(findings, facts)
