"""Pick the initiating failure and label the rest as cascade or teardown.

Evidence is ordered by timestamps where two lines carry comparable ones, else by input order.
The initiating failure is the earliest root candidate (a rank's own error: an exception, an OOM,
a segfault); the same error on several ranks is one root with a rank set. Without a root
candidate, "either" evidence decides (a SIGABRT, an NCCL system error, a bare exit code). With
only consequences left, collective timeouts point at the rank that is missing from them
(timeouts.py). The values passed around are in roots.py."""

from __future__ import annotations

from dataclasses import replace

from logtriage.analysis.findings import Finding
from logtriage.analysis.first_signs import (LOGGED_RULE, from_first_logged_sign, numerical_signs_first,
                                            reports_death_after_own_error)
from logtriage.analysis.live_errors import EXIT_RULE, live_errors
from logtriage.analysis.group_ranks import odd_rank_out, rank_among_alike, rank_of_a_line_without_one
from logtriage.analysis.rank_evidence import all_exited_alike, missing_from_barrier
from logtriage.analysis.roots import RankFacts, RootCause, earliest, ranks_of
from logtriage.analysis.timeouts import missing_rank_root
from logtriage.analysis.timestamps import clearly_before
from logtriage.catalog.rule import Category, Role, Severity
from logtriage.demux.streams import StreamKind


def choose_root(findings: list[Finding], facts: RankFacts) -> RootCause | None:
    live = live_errors(findings, facts)
    roots = [f for f in live if f.role is Role.ROOT_CANDIDATE and not reports_death_after_own_error(f, live)]
    roots = numerical_signs_first(roots, live)
    roots, onset = from_first_logged_sign(roots, live)
    if roots:
        before = _errors_before_stop(roots, live)
        if before:
            return _group_root(before, live, facts, 0.6, onset)
        timed_out = _timeouts_before_stop(roots, live)
        if timed_out:
            return missing_rank_root(timed_out, live, facts, findings)
        return _group_root(roots, live, facts, 0.9, onset)
    explained = _explained_in(live)
    either = [f for f in live if f.role is Role.EITHER and not explained(f)]
    if _collective_timeouts(live):
        # Exit codes and signals seen by the launcher (-6 after an NCCL watchdog abort) are how
        # timed-out processes end, and what a timeout's stamp shows came later is its aftermath
        # (a heartbeat monitor firing minutes after the watchdog): the timeouts say more. So do
        # they than a bare exit code reported after them (srun's, pdsh's notices at the end).
        timeouts = [f for f in live if f.category is Category.COLLECTIVE_TIMEOUT
                    and f.role is not Role.CAUSE_CONFIRMATION]
        either = [f for f in either if f.attributed_by != "launcher" and f.category is not Category.CRASH_SIGNAL
                  and not (f.category is Category.UNKNOWN and any(t.seq < f.seq for t in timeouts))
                  and not any(clearly_before(t.stamp, f.stamp) or _hang_after(t, f) for t in timeouts)]
    if either:
        # a signal or an error beats a bare exit code, and so does a node's notice of an exit
        # (pdsh's `ssh exited with exit code 1`) unless that rank's own exit code is in the log
        # (torchelastic's `failed (exitcode: 3) local_rank: 1`)
        specific = [f for f in either if f.rule.id != EXIT_RULE and not _notice_of_own_exit(f, either)] or either
        confidence = 0.6 if specific[0].rule.id != EXIT_RULE else 0.35
        specific, onset = from_first_logged_sign(specific, live)
        # a logged record yields to what its rank's own later error says (it dates that error), in the same
        # attempt: a restarted worker's error is the restart's, not what the record said
        specific = [f for f in specific if f.rule.id != LOGGED_RULE or not any(
            g.rank == f.rank and g.stream.attempt == f.stream.attempt and g.rule.id != LOGGED_RULE
            and not _launcher_signal(g) for g in specific)] or specific
        specific = [f for f in specific if not _launcher_signal(f) or not any(
            g.rank == f.rank and g.rule.id == LOGGED_RULE for g in specific)] or specific
        return _group_root(specific, live, facts, confidence, onset)
    timeouts = [f for f in live if f.category is Category.COLLECTIVE_TIMEOUT and f.role is not Role.CAUSE_CONFIRMATION]
    if timeouts:
        return missing_rank_root(timeouts, live, facts, findings)
    cascade = [f for f in live if f.role is Role.CASCADE_CANDIDATE]
    if cascade:
        first = earliest(cascade)
        ranks = ranks_of(f for f in cascade if f.signature == first.signature)
        return RootCause(first.rule, first, first.rank, ranks, 0.3,
                         ("only consequences were found; the initiating error is not in this log",))
    return None


# what a job stopped by the scheduler shows as its stop, not as an error of its own
_STOP_ECHOES = frozenset({Category.EXTERNAL_STOP, Category.CRASH_SIGNAL, Category.UNKNOWN, Category.HANG})


def _launcher_signal(finding: Finding) -> bool:
    """The launcher's report of the signal a rank died of (torchelastic's `failed (exitcode: -6) local_rank: 2`)."""
    return finding.category is Category.CRASH_SIGNAL and finding.attributed_by == "launcher"


def _notice_of_own_exit(finding: Finding, either: list[Finding]) -> bool:
    """A launcher's notice that a node or task exited non-zero (its category unknown), for a rank
    (or, naming none, a node) whose worker's own exit code the log also holds."""
    return (finding.category is Category.UNKNOWN and finding.rule.id != EXIT_RULE
            and any(f.rule.id == EXIT_RULE and f.rank is not None and finding.rank in (None, f.rank) for f in either))


def _errors_before_stop(roots: list[Finding], live: list[Finding]) -> list[Finding]:
    """A job the scheduler stopped (a time limit, a cancel) after an error (an InfiniBand
    completion error, then nothing until the time limit) was stuck on that error: the error is
    the root. Only ambiguous errors need this; root candidates before the stop already win."""
    if not all(f.category is Category.EXTERNAL_STOP for f in roots):
        return []
    stop = earliest(roots)
    explained = _explained_in(live)
    return [f for f in live if f.role is Role.EITHER and f.category not in _STOP_ECHOES
            and f.attributed_by != "launcher" and not explained(f)
            and earliest([f, stop]) is f and f.seq < stop.seq]


def _timeouts_before_stop(roots: list[Finding], live: list[Finding]) -> list[Finding]:
    """The collective timeouts before a stop from outside (ranks that gave up waiting for one that never
    came, then a `timeout` or a person stopped what was left): they point at the missing rank, as without
    the stop."""
    if not all(f.category is Category.EXTERNAL_STOP for f in roots):
        return []
    stop = earliest(roots)
    return [f for f in live if f.category is Category.COLLECTIVE_TIMEOUT and f.role is not Role.CAUSE_CONFIRMATION
            and earliest([f, stop]) is f and f.seq < stop.seq]


def warning_root(findings: list[Finding]) -> RootCause | None:
    """For a run that failed without an error line: the warnings that led there (an fp16 loss
    scale halving until training aborted)."""
    warnings = [f for f in findings if f.rule.severity is Severity.WARNING and not f.is_teardown
                and f.rule.role in (Role.ROOT_CANDIDATE, Role.EITHER, Role.CAUSE_CONFIRMATION)]
    if not warnings:
        return None
    first = earliest(warnings)
    group = [f for f in warnings if f.rule.id == first.rule.id]
    return RootCause(first.rule, first, first.rank, ranks_of(group), 0.3, (
        f"the run failed without an error line; {len(group)} warning(s) of this kind came before the end",))


def _collective_timeouts(live: list[Finding]) -> bool:
    return any(f.category is Category.COLLECTIVE_TIMEOUT or f.rule.id == "nccl.async_abort" for f in live)


def _hang_after(timeout: Finding, finding: Finding) -> bool:
    """A stuck-watchdog report (NCCL's heartbeat monitor) after a collective timeout in the same
    process: the watchdog got stuck handling that timeout, so the timeout says more (their stamps
    may not compare: a wrapped line loses its header)."""
    return (finding.category is Category.HANG and timeout.seq < finding.seq
            and (timeout.rank is None or finding.rank is None or timeout.rank == finding.rank))


def _explained_in(live: list[Finding]):
    """A predicate: whether an ambiguous finding (a SIGABRT, an exit code) is on a rank that already
    reported an error of its own (a watchdog timeout, a peer error): then it is that error's
    consequence. A launcher summary line about a rank is explained by anything that rank printed.
    The launcher's own header about a rank (`-- Process 1 terminated with the following error:`)
    explains nothing: the rank's error follows it. (Each rank's first explaining line, found once:
    thousands of ranks' findings are read in one pass.)"""
    first: dict[int, int] = {}
    for other in live:
        if other.rank is None or other.role is Role.EITHER or (
                other.stream.kind is StreamKind.LAUNCHER and other.role is Role.CASCADE_CANDIDATE):
            continue
        if other.rank not in first or other.seq < first[other.rank]:
            first[other.rank] = other.seq

    def explained(finding: Finding) -> bool:
        seq = first.get(finding.rank) if finding.rank is not None else None
        return seq is not None and (finding.attributed_by == "launcher" or seq < finding.seq)
    return explained


GENERIC_EXCEPTION_RULE = "python.exception"
MESSAGE_LINES = 4   # how far below an exception line its message's own lines may reach


def _specific_in_block(first: Finding, candidates: list[Finding]) -> Finding:
    """An exception matched only by its type, whose multi-line message goes on to lines a
    specific rule knows (fairseq's FloatingPointError followed by its per-rank `rank 3 = nan`
    table, a few lines below it and outside any other block): the specific reading of the same
    exception is the root."""
    if first.rule.id != GENERIC_EXCEPTION_RULE:
        return first
    specific = next((f for f in candidates if f.source == first.source and 0 < f.line - first.line <= MESSAGE_LINES
                     and f.rule.id != GENERIC_EXCEPTION_RULE and f.block_id in (first.block_id, -1)
                     and f.stream.kind is not StreamKind.LAUNCHER), None)   # the launcher's lines are its own
    if specific is None:
        return first
    # the message's lines belong to the exception's process and carry its type
    return replace(specific, block_exception=first.text, rank=first.rank if specific.rank is None else specific.rank)


def _group_root(candidates: list[Finding], live: list[Finding], facts: RankFacts, confidence: float,
                onset: dict[int, Finding] | None = None) -> RootCause:
    """The earliest candidate (dated by its rank's earlier logged error where `onset` has one) and
    the candidates that are the same error, as one root with their ranks."""
    keyed = [(onset.get(id(f), f) if onset else f, f) for f in candidates]
    lead = earliest([key for key, _ in keyed])
    chosen = next(f for key, f in keyed if key is lead)
    dated = bool(onset) and id(chosen) in onset     # its rank logged the error before the others' were printed
    first = _specific_in_block(chosen, candidates)
    group = [f for f in candidates if f.signature == first.signature or _raised_at_the_same_place(f, first)]
    if first.category is Category.CRASH_SIGNAL and first.attributed_by == "launcher":
        # the launcher reports each worker's signal in its own words (its `failed` line, the
        # summary's entries): the workers that died of the same signal are one group
        group = [f for f in candidates if f.rule.id == first.rule.id and f.attributed_by == "launcher"]
    ranks = ranks_of(group)
    rank = first.rank
    reasons: list[str] = []
    if not ranks and len(group) >= 2 and len(group) == len(facts.known):
        ranks = tuple(sorted(facts.known))  # one unprefixed copy per rank (before the process group existed)
    if len(ranks) > 1:
        rank, reasons = rank_among_alike(first, group, live, facts, ranks, dated)
    elif rank is None and (alike := all_exited_alike(first, group, live, facts)):
        rank, ranks = min(alike), alike
        reasons.append(f"the line carries no rank; it is printed more than once and all {len(alike)} ranks "
                       f"exited with the same code: a code or data bug shared by all")
    elif rank is None and (found := rank_of_a_line_without_one(first, live, facts)) is not None:
        rank, why = found
        ranks, confidence = (rank,), confidence - 0.15
        reasons.append(why)
    missing = missing_from_barrier(group)
    if missing:
        rank, ranks = missing[0], tuple(missing)
        reasons.append(f"rank(s) {', '.join(map(str, missing))} never reached the start-up barrier the others "
                       f"waited in")
    return odd_rank_out(first, live, facts, rank, ranks, confidence, reasons)


def _raised_at_the_same_place(f: Finding, first: Finding) -> bool:
    """The same exception type raised by the same innermost function on another rank, with a
    message that differs only in what it names (`model.embed_tokens.weight doesn't have any device
    set.` on rank 0, `model.layers.0...` on rank 1): one bug, as the same line would be."""
    return (f.rule.id == first.rule.id and f.rank != first.rank and bool(first.last_frame)
            and f.last_frame == first.last_frame and f.exception_type is not None
            and f.exception_type == first.exception_type)
