"""Errors a rank lived through: printed, then gone on from. A later exception of another type in the
same rank's stream, or an error every rank printed and kept training after, on workers the agent
stopped, did not end the run. A rank's own progress lines after its error are no sign alone: a
worker's stdout, buffered, is often printed after the traceback its stderr had already shown (torchrun's
`--tee` reads the two apart), so the launcher's word on how each worker ended is needed too."""

from __future__ import annotations

import re

from logtriage.analysis.childfailed import is_own_failure
from logtriage.analysis.findings import Finding
from logtriage.analysis.roots import RankFacts
from logtriage.analysis.timestamps import clearly_before, parse_stamp
from logtriage.catalog.rule import Category, Role
from logtriage.demux.streams import StreamKind


def lived_through(live: list[Finding], facts: RankFacts) -> list[Finding]:
    """The live findings without the candidate roots a rank lived through (an exception followed in
    its stream by one of another type; an error every rank printed and trained on after, on a worker
    the agent stopped), unless nothing but consequences would be left."""
    if not facts.last_progress:
        return live
    reports, sharers = launcher_reports(live), ranks_by_rule(live)
    fatal = _what_ranks_died_of(live, facts)
    kept = [f for f in live if f.role not in (Role.ROOT_CANDIDATE, Role.EITHER)
            or not ((f.signature not in fatal and progress_after(f, facts, reports, sharers))
                    or _another_error_later(f, live))]
    # only consequences left (peers that lost the rank which went on out of step): the error it
    # went on from is still where it started
    return kept if any(f.role in (Role.ROOT_CANDIDATE, Role.EITHER) for f in kept) else live


# what a process never goes on from (its own fatal signal, whose buffered output is printed after it), or
# what no progress line can undo (a stop, a hang): no reading of progress after them
_NOT_GONE_ON = frozenset({Category.CRASH_SIGNAL, Category.HANG, Category.EXTERNAL_STOP, Category.PERFORMANCE_VALIDITY})
_EXCEPTION_LINE = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt))\b")
# a progress line at warning or error level (`WARNING step 3: writing emergency checkpoint`): no sign of going on
_NOT_ROUTINE = re.compile(r"\b(?:WARN(?:ING)?|ERROR|CRITICAL|FATAL)\b")
# a loss that is not a number: training goes on printing it, so only a finite loss after it is a recovery
_NONFINITE = re.compile(r"\b(?:nan|inf)\b", re.IGNORECASE)


def _what_ranks_died_of(live: list[Finding], facts: RankFacts) -> set[str]:
    """The signatures of the last error of each rank that ended of its own failure (the launcher's
    exit code): an error that ended some ranks is no error the others went on from, though their
    buffered progress lines come after it (`--tee`: stderr's traceback before stdout's last steps)
    and the agent stopped them with SIGTERM while they were dying of it."""
    last: dict[int, Finding] = {}
    for f in live:
        if f.rank is not None and f.stream.kind is StreamKind.RANK and f.role in (Role.ROOT_CANDIDATE, Role.EITHER) \
                and f.block_id >= 0:
            last[f.rank] = f
    # (with every exception of that traceback: a chain's first exception, `The above exception was the
    # direct cause ...`, ended the rank as much as the one it raised)
    ended = {(f.source, f.block_id) for rank, f in last.items()
             if rank in facts.exit_codes and is_own_failure(facts.exit_codes[rank])}
    return {f.signature for f in live if (f.source, f.block_id) in ended and f.rank is not None
            and f.role in (Role.ROOT_CANDIDATE, Role.EITHER)}


def _another_error_later(finding: Finding, live: list[Finding]) -> bool:
    """A rank's exception followed, in its own stream, by an exception of another type in a later
    traceback (not a lost peer, not a signal): the process lived through the first (a caught
    evaluation error, then the one that ended it)."""
    if finding.stream.kind is not StreamKind.RANK or finding.block_id < 0 or finding.category in _NOT_GONE_ON \
            or finding.category is Category.NUMERICAL or finding.in_thread:
        return False   # (a thread that died left its work undone: what fails later follows from it)
    kind = _exception_type(finding)
    if not kind:
        return False   # (a C++ log line and the Python exception it becomes are one failure)
    return any(f.stream == finding.stream and f.source == finding.source and f.line > finding.line
               and f.block_id >= 0 and f.block_id != finding.block_id and f.role is Role.ROOT_CANDIDATE
               and f.category not in _NOT_GONE_ON and _exception_type(f) not in (None, kind) for f in live)


def _exception_type(finding: Finding) -> str | None:
    """The type of the exception a traceback's finding ends with (its rule's capture, or the block's line)."""
    named = finding.captures.get("exception_type")
    if named:
        return named
    m = _EXCEPTION_LINE.match(finding.block_exception or "")
    return m.group(1) if m else None


def ranks_by_rule(live: list[Finding]) -> dict[str, set[int]]:
    ranks: dict[str, set[int]] = {}
    for f in live:
        if f.stream.kind is StreamKind.RANK and f.rank is not None:
            ranks.setdefault(f.rule.id, set()).add(f.rank)
    return ranks


def launcher_reports(live: list[Finding]) -> dict[tuple[int, int], list[int]]:
    """(source, rank) -> the lines where the launcher reported that rank's worker failed."""
    reports: dict[tuple[int, int], list[int]] = {}
    for f in live:
        if f.stream.kind is StreamKind.LAUNCHER and f.rank is not None:
            reports.setdefault((f.source, f.rank), []).append(f.line)
    return reports


def progress_after(finding: Finding, facts: RankFacts, reports: dict[tuple[int, int], list[int]],
                    sharers: dict[str, set[int]]) -> bool:
    """Whether the finding's rank (or, for a line no rank claims, every rank) made progress after it in
    a way that shows the process went on: an error every rank printed, on a worker the launcher says
    did not end of its own failure, with progress after it and before any launcher report of that
    worker failing (a restart's next attempt is another process)."""
    if finding.category in _NOT_GONE_ON:
        return False
    if not facts.exit_codes:
        return False   # without the launcher's word on how each worker ended, buffered output misleads
    if finding.stream.kind is StreamKind.UNATTRIBUTED and finding.rank is None:
        # a line no rank claims, around which every rank made progress (a traceback each rank printed)
        spans = list(facts.last_progress.values())
        return len(spans) >= 2 and all(_around(span, finding) for span in spans)
    span = facts.last_progress.get(finding.stream) if finding.stream.kind is StreamKind.RANK else None
    if span is None or finding.rank not in facts.exit_codes or is_own_failure(facts.exit_codes[finding.rank]):
        return False   # a worker that ended of its own failure (or whose end is not known) did not go on
    if _logged_later(finding, span):
        # its own progress records, stamped later than the error by the same process's clock: it went on
        # (no buffering can reorder what the times say)
        return not any(finding.line < line < span[2] for line in reports.get((finding.source, finding.rank), ()))
    spans = [s for s in facts.last_progress.values() if s[0] == finding.source]
    # an error every rank printed (an optional import, a metrics client, a flaky read), after which this
    # rank's progress goes on, and which the launcher says it did not die of (checked above)
    printed_by = sharers.get(finding.rule.id, set())
    shared = len(spans) >= 2 and len(printed_by) >= len(spans) and span[2] > finding.line \
        and finding.category is not Category.NUMERICAL
    if not shared:
        return False   # (a rank's own progress after its error is no sign alone: its stdout, buffered,
        #               is often printed after the traceback its stderr had already shown)
    return not any(finding.line < line < span[2] for line in reports.get((finding.source, finding.rank), ()))


def _logged_later(finding: Finding, span: tuple[int, int, int, str]) -> bool:
    """Whether the rank's last progress line comes after the finding in the log and carries a time
    clearly later than the finding's own (or its error record's)."""
    source, _, last, text = span
    if finding.stamp is None or source != finding.source or last <= finding.line or _NOT_ROUTINE.search(text):
        return False   # (a warning or an error that names a step, `step 3: writing emergency checkpoint`, is no progress)
    return clearly_before(finding.stamp, parse_stamp(text.strip())) is True



def _around(span: tuple[int, int, int, str], finding: Finding) -> bool:
    """Progress lines before the finding and after it, the last with a finite loss after a NaN. Both
    are needed: a worker's stdout, buffered, is often printed after the traceback its stderr had
    already shown (torchrun's --tee reads the two apart)."""
    source, first, last, text = span
    return source == finding.source and first < finding.line < last and not (
        finding.category is Category.NUMERICAL and _NONFINITE.search(text))
