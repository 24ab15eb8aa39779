"""The verdict (failed, hung, ok) on the root read so far, and, where no failure was found, the hang's
reading: ranks that never formed the group, a wait with no end, uneven progress, a start-up stalled in
NCCL, an unknown error line at the log's end, or output that just stops."""

from __future__ import annotations

import re
from dataclasses import replace

from logtriage.analysis.evidence import Evidence
from logtriage.analysis.hangs import hang_from_progress, stalled_in_nccl_init, waiting, world_incomplete
from logtriage.analysis.lone_notice import hang_answered_alone
from logtriage.analysis.recovered import GROUP_SUCCEEDED
from logtriage.analysis.refine import STOPPED_WHILE_WAITING
from logtriage.analysis.roots import RootCause, Verdict
from logtriage.analysis.stalls import behind_ranks_ended, heartbeat_odd_one_out, late_rank_went_on
from logtriage.analysis.stopped import (FINISHED_RULE, log_tail, output_stopped, still_retrying, stuck_after_warning,
                                        unknown_error_line)
from logtriage.catalog.rule import Category, Role

__all__ = ["read_verdict"]

# the agent's word that its worker group succeeded, or DeepSpeed's launcher's for one process
_LAUNCHER_SUCCESS = re.compile(f"{GROUP_SUCCEEDED.pattern}|Process \\d+ exits successfully")


def read_verdict(ev: Evidence, root: RootCause | None) -> tuple[RootCause | None, Verdict]:
    scan, keys, findings, facts, catalog = ev.scan, ev.keys, ev.findings, ev.facts, ev.catalog
    verdict = Verdict.FAILED if root is not None else Verdict.OK
    if root is not None and (root.rule.id == STOPPED_WHILE_WAITING or root.rule.stuck):
        verdict = Verdict.HUNG
    elif root is not None and still_retrying(scan, root, findings):
        verdict = Verdict.HUNG
        root = replace(root, reasons=root.reasons + (
            "the log ends on the store client's note that it will try again: it was still retrying when the "
            "output stops, so the run hangs there (the store's host is gone or unreachable)",))
    if root is None or root.rule.category in (Category.EXTERNAL_STOP, Category.UNKNOWN) or root.rule.role in (
            Role.EITHER, Role.CASCADE_CANDIDATE):
        # processes that never formed the group explain a start-up hang, a job stopped during
        # one, or a failure whose own cause the log does not hold or is ambiguous (a wrapper's
        # announcement, a consequence with nothing before it, an exit code) when ranks were claimed twice
        stopped = root is not None and root.rule.category is Category.EXTERNAL_STOP
        incomplete = world_incomplete(findings, catalog, root if stopped else None)
        if incomplete is not None and (root is None or stopped or incomplete.ranks):
            verdict = Verdict.FAILED if root is not None else Verdict.HUNG
            root = incomplete
    if root is None:
        root = waiting(findings, facts)
        if root is None and not scan.unreadable:   # output that stops where the input broke off says nothing
            finished = any(f.rule.id == FINISHED_RULE for f in findings)   # its NCCL teardown is no stall
            # the launcher's own word that every worker exited 0: uneven progress lines are no hang
            all_done = any(f.rule.id == FINISHED_RULE and _LAUNCHER_SUCCESS.search(f.text) for f in findings)
            uneven = None if all_done else behind_ranks_ended(scan, keys, hang_from_progress(facts, catalog), facts)
            root = uneven or (
                None if finished else stalled_in_nccl_init(scan, findings, facts, catalog))
        if root is not None:
            verdict = Verdict.HUNG
    if root is None:   # the log's end: an error no rule knows fails the run, else the output just stops
        tail = log_tail(scan, findings, facts)
        root = unknown_error_line(scan, keys, tail, catalog, frozenset((f.source, f.line) for f in findings))
        verdict = Verdict.FAILED if root is not None else Verdict.OK
        if root is None:
            root = stuck_after_warning(tail, findings) or output_stopped(scan, keys, tail, facts, catalog)
            if root is not None:
                root = late_rank_went_on(scan, keys, heartbeat_odd_one_out(scan, keys, root), findings)
            verdict = Verdict.HUNG if root is not None else Verdict.OK
    if verdict is Verdict.HUNG and root is not None:
        root = hang_answered_alone(root, ev.notices, facts)
    return root, verdict
