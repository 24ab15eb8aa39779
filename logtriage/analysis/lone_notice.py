"""A stop that only one rank answered. A worker's Python signal handler (Lightning's `[rank: 2] Received
SIGTERM: 15`, a script's own) runs only when that process is running Python: a rank blocked in a collective
sits in C++ and says nothing until the collective returns. When every rank of a hung run got the stop but
exactly one printed its notice, that rank was busy elsewhere while the others waited for it in a collective:
it is the rank the run hung on. A healthy job's ranks all answer a stop."""

from __future__ import annotations

from dataclasses import replace

from logtriage.analysis.findings import Finding
from logtriage.analysis.refine import stopped_while_waiting_rule
from logtriage.analysis.roots import RankFacts, RootCause
from logtriage.analysis.signal_readings import STOP_NOTICE
from logtriage.catalog.loader import Catalog
from logtriage.scan_result import ScanResult


def stop_notices(findings: list[Finding]) -> list[Finding]:
    """The workers' own notices that they were sent a stop, wherever in the log they stand."""
    return [f for f in findings if f.rule.id == STOP_NOTICE]


def answered_alone(notices: list[Finding], facts: RankFacts) -> int | None:
    """The one rank that printed a stop notice, when two or more ranks printed progress, that rank among
    them, and no other rank printed one."""
    ranks = {f.rank for f in notices if f.rank is not None and f.rank >= 0}
    if len(ranks) != 1 or len(facts.last_step) < 2:
        return None
    rank = next(iter(ranks))
    return rank if rank in facts.last_step else None


def hang_answered_alone(root: RootCause, notices: list[Finding], facts: RankFacts) -> RootCause:
    """A hang with no rank named, where one rank alone answered the stop that ended it: that rank."""
    if root.rank is not None or root.ranks:
        return root
    rank = answered_alone(notices, facts)
    if rank is None:
        return root
    return replace(root, rank=rank, ranks=(rank,), reasons=root.reasons + (_why(rank, notices),))


def notice_ended_hang(scan: ScanResult, root: RootCause, findings: list[Finding], notices: list[Finding],
                      facts: RankFacts, catalog: Catalog) -> RootCause:
    """A rank's stop notice as the root, the last line of its input, nothing else failed, and every other
    rank that printed progress silent at the stop: the ranks were waiting in a collective for the one that
    answered, and the stop ended that hang (a preemption of a live job is answered by every rank).
    `notices`: every stop notice, those printed after the launcher's teardown began among them."""
    stop = root.finding
    if stop is None or stop.rule.id != STOP_NOTICE or stop.source >= len(scan.indexes):
        return root
    rank = answered_alone(notices, facts)
    if rank is None or rank != root.rank or stop.line < len(scan.indexes[stop.source].offsets):
        return root
    if any(f.fails_beyond_a_stop for f in findings):
        return root
    if any(line > stop.line for source, _, line, _ in facts.last_progress.values() if source == stop.source):
        return root
    return replace(root, rule=stopped_while_waiting_rule(catalog), confidence=min(root.confidence, 0.4),
                   reasons=root.reasons + (
        "nothing failed and the log ends on this notice: the stop ended a wait", _why(rank, notices)))


def _why(rank: int, notices: list[Finding]) -> str:
    line = min(f.line for f in notices if f.rank == rank)
    return (f"only rank {rank} answered the stop (line {line}): a rank's signal handler runs only while it runs "
            f"Python, so the other ranks sat in a collective waiting, and rank {rank} was where the run hung")
