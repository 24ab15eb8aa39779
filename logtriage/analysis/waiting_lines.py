"""A job stopped from outside (a `timeout`'s or a scheduler's SIGTERM, a Ctrl-C) whose workers' last
words before the stop say they wait (`waiting for the data cache /data/cache/READY`, `cache is locked
by pid 48213 ..., waiting`, `atexit: waiting for 6 pending metric uploads`), with nothing failing
since: the stop ended a wait that was not going to end. Where one rank's last line says it waits and
every other rank's last line says something else, that rank is where the job stuck. A job stopped by
a SIGTERM or Ctrl-C half a minute or more after the launcher started it, before any rank printed a
single step and with nothing failed, never got through its start-up: it hung there, where the one rank
whose last line differs from all the others' (they reached the same point) kept them waiting."""

from __future__ import annotations

import re
from dataclasses import replace

from logtriage.analysis.early_stop import STOPPED_EARLY
from logtriage.analysis.findings import Finding, mask_numbers
from logtriage.analysis.hangs import EXIT_STALLED
from logtriage.analysis.last_lines import (WAITING_WORDS, at_work_alone, fell_behind_alone, last_worker_lines,
                                          stopped_at_a_shared_line, went_on_alone, went_on_past_the_others)
from logtriage.analysis.odd_start import odd_line_out
from logtriage.analysis.rank_evidence import odd_one_out
from logtriage.analysis.refine import at_the_odd_step, stopped_while_waiting_rule
from logtriage.analysis.roots import RankFacts, RootCause
from logtriage.analysis.signal_readings import TEARDOWN_RULE
from logtriage.analysis.timestamps import Stamp, parse_stamp
from logtriage.catalog.loader import Catalog
from logtriage.catalog.rule import Category
from logtriage.demux.streams import StreamKey
from logtriage.ingest.lines import read_lines
from logtriage.scan_result import ScanResult, step_number

WAIT_SECONDS = 30.0   # a stamped wait shorter than this when the stop came is no hang (a component stopped it)
STARTUP_SECONDS = 30.0   # from the launcher's start to the stop, no step printed: start-up had stuck
# the launcher's words for the signal it got: SIGTERM (a `timeout`, a scheduler) or SIGINT (Ctrl-C);
# a SIGHUP is a closed terminal, which says nothing of the job
_STOPPED_BY = re.compile(r"Received (15|2|SIGTERM|SIGINT) death signal|got signal: (15|2)\b")
_TERMINATION = frozenset({"15", "SIGTERM"})   # of those, the signal a `timeout` or a time limit sends
# since the wait began, these are no failure of their own: the stop, and a watchdog's report of the
# stall (faulthandler's `Timeout (0:00:10)!` stacks) that says the wait went on
_NOT_FAILURES = frozenset({Category.EXTERNAL_STOP, Category.HANG})


def waiting_before_stop(scan: ScanResult, keys: list[StreamKey], root: RootCause, findings: list[Finding],
                        catalog: Catalog) -> RootCause:
    """An external stop that ended a wait (the workers' last words), read as the hang it ended; a
    hang at exit (hang.exit_stalled) with no rank gets the one rank still waiting."""
    stop = root.finding
    stopped = root.rule.category is Category.EXTERNAL_STOP
    if stop is None or stop.source >= len(scan.sources) or not (
            stopped or (root.rule.id == EXIT_STALLED and root.rank is None)):
        return root
    last, by_rank = last_worker_lines(scan, keys, stop.source, stop.line)
    waiting = [rank for rank, (_, text) in by_rank.items() if WAITING_WORDS.search(text)]
    # (one rank alone speaking of the workers the launcher stopped, not rank 0, which may log for all: the
    # silent ones waited for it)
    alone = len(by_rank) == 1 and 0 not in by_rank and _workers_stopped(findings, stop.source) >= 2
    rank = waiting[0] if len(waiting) == 1 and (len(by_rank) >= 2 or alone) else None
    odd = odd_line_out({r: text for r, (_, text) in by_rank.items()}) if len(waiting) == len(by_rank) else None
    said = by_rank[rank] if rank is not None else by_rank[odd] if odd is not None else last
    if said is None or not WAITING_WORDS.search(said[1]):
        return root
    reasons = ((f"rank {rank}'s last line before the stop says it waits (`{said[1][:120]}`), and every other "
                "rank's last line says something else" + (" (they printed none)" if alone else "")
                + ": the job stuck where rank " + str(rank) + " waited",) if rank is not None else ())
    if odd is not None:
        rank, reasons = odd, (f"every rank's last line before the stop says it waits, and all say the same (each "
                              f"with its own rank's number) but rank {odd}'s (`{said[1][:120]}`): it waits for "
                              "something else than the others, which wait for what it did not do",)
    if not stopped:
        return replace(root, rank=rank, ranks=(rank,), reasons=root.reasons + reasons)
    waited = _seconds_between(parse_stamp(said[1]), stop.stamp)
    if waited is not None and waited < WAIT_SECONDS:
        return root   # a wait of a few seconds when the stop came: the job was stopped, it had not stuck
    if any(f.is_error and not f.is_teardown and f.category not in _NOT_FAILURES and f.source == stop.source
           and said[0] < f.line < stop.line for f in findings):
        return root
    rule = stopped_while_waiting_rule(catalog)
    return replace(root, rule=rule, rank=rank, ranks=(rank,) if rank is not None else (),
                   confidence=min(root.confidence, 0.45), reasons=root.reasons + (
                       f"the workers' last words before the stop (line {said[0]}: `{said[1][:120]}`) say they wait, "
                       "and nothing failed since: the stop ended a wait that was not going to end",) + reasons)


def _seconds_between(begun: Stamp | None, end: Stamp | None) -> float | None:
    """Seconds from one line's time to another's: of one kind, or a bare time of day (a script's own
    `12:13:46 INFO`) against a dated one (the launcher's), by the time of day (within a day)."""
    if begun is None or end is None:
        return None
    if begun.family == end.family:
        return end.seconds - begun.seconds
    if begun.family == "clock" and end.family in ("glog", "cpp-glog", "iso"):
        return (end.seconds % 86400 - begun.seconds) % 86400
    return None


def stopped_in_startup(scan: ScanResult, keys: list[StreamKey], root: RootCause, findings: list[Finding],
                       facts: RankFacts, catalog: Catalog) -> RootCause:
    """An external stop, STARTUP_SECONDS or more after the launcher's first stamped line, of a job
    none of whose ranks printed a step and nothing of which failed: it hung in its start-up
    (a rendezvous or an init that never completed, a wait on a file or a lock)."""
    stop = root.finding
    if (not _signalled_stop_alone(root, findings) or stop.stamp is None or stop.source >= len(scan.sources)
            or facts.last_step or not (facts.known or any(f.rule.id == TEARDOWN_RULE for f in findings))):
        return root     # (workers the launcher stopped by pid, where no line names a rank, were there too)
    ran = _seconds_before_stop(scan, stop)
    if ran is None or ran < STARTUP_SECONDS:
        return root
    rule = stopped_while_waiting_rule(catalog)
    hung = replace(root, rule=rule, rank=None, ranks=(), confidence=min(root.confidence, 0.35), reasons=root.reasons + (
        f"the launcher started the job {ran:.0f} s before the stop, and no rank "
        "printed a single step and nothing failed: start-up never completed (a rendezvous, an init, a wait on a "
        "file or a lock), and the stop ended that hang",))
    workers = max(len(facts.known), _workers_stopped(findings, stop.source))
    rank = at_work_alone(scan, keys, stop.source, stop.line, workers)
    if rank is not None:
        return replace(hung, rank=rank, ranks=(rank,), reasons=hung.reasons + (
            f"rank {rank} went on printing what it did after every other rank fell silent: it was still at work, "
            "and the others waited for it",))
    _, by_rank = last_worker_lines(scan, keys, stop.source, stop.line)
    said = {r: text for r, (_, text) in by_rank.items()}
    # (exactly, each number the same or the line's own rank; else numbers aside: `rank 2: tokenizer cache stale,
    # re-tokenising the full split` against `rank N: 24 examples -> 46 windows`)
    odd = (odd_line_out(said) or odd_one_out({r: mask_numbers(t).strip() for r, t in said.items()})
           if len(by_rank) == workers else None)
    if not odd:   # (rank 0 alone saying something else is a program that logs more on rank 0)
        return hung
    return replace(hung, rank=odd, ranks=(odd,), reasons=hung.reasons + (
        f"every rank's last line before the stop is the same but rank {odd}'s (`{by_rank[odd][1][:120]}`): the "
        "others had gone on to the same point and waited there for it",))


def stopped_before_all_stepped(scan: ScanResult, root: RootCause, findings: list[Finding], facts: RankFacts,
                               catalog: Catalog) -> RootCause:
    """An external stop with nothing failed, STARTUP_SECONDS or more after the launcher started the
    job, when some ranks had printed a step and the others none at all: ranks that step together
    had parted before the first step was done. The one rank that stands apart (alone in printing a
    step, or alone in printing none) went its own way; the others waited for it."""
    steps, known = facts.last_step, facts.known
    stop = root.finding
    if (not _signalled_stop_alone(root, findings) or stop.stamp is None or stop.source >= len(scan.sources)
            or not steps or len(known) < 3 or known <= steps.keys() or not steps.keys() <= known):
        return root
    ran = _seconds_before_stop(scan, stop)
    if ran is None or ran < STARTUP_SECONDS:
        return root
    stepped, silent = set(steps), known - set(steps)
    odd = next(iter(stepped)) if len(stepped) == 1 else next(iter(silent)) if len(silent) == 1 else None
    rule = stopped_while_waiting_rule(catalog)
    hung = replace(root, rule=rule, rank=None, ranks=(), confidence=min(root.confidence, 0.35), reasons=root.reasons + (
        f"no error, {ran:.0f} s from the job's start to the stop, and only rank(s) "
        f"{', '.join(map(str, sorted(stepped)))} had printed a step: the ranks had stopped moving together before "
        "the first step was done, and the stop ended the wait",))
    if odd is None:
        return hung
    return replace(hung, rank=odd, ranks=(odd,), reasons=hung.reasons + (
        f"rank {odd} is the only rank that " + ("printed a step" if odd in stepped else "printed no step")
        + ": it went its own way (a collective skipped or added), and the others waited for it",))


def stopped_after_one_went_on(scan: ScanResult, keys: list[StreamKey], root: RootCause, findings: list[Finding],
                              facts: RankFacts, catalog: Catalog) -> RootCause:
    """An external stop with nothing failed, STARTUP_SECONDS or more after the launcher started the job,
    where every rank's last line before it is its progress line at one step but one rank's, which said
    what it went on to do (`rank 2: recomputing precise BN statistics over 150 batches`): the others
    waited for it in the next step's collective, and the stop ended that hang."""
    stop = root.finding
    if (not _signalled_stop_alone(root, findings) or stop.stamp is None or stop.source >= len(scan.sources)
            or len(facts.known) < 3):
        return root
    found = _one_rank_apart(scan, keys, stop, facts)
    if found is None:
        return root
    # (no line before the stop stamped as it is, the launcher's banner switched off: its time is unknown, and what
    # the ranks' last lines say stands alone)
    ran = _seconds_before_stop(scan, stop)
    if ran is not None and ran < STARTUP_SECONDS:
        return root
    rank, why = found
    took = "" if ran is None else f"{ran:.0f} s from the job's start to the stop, "
    return replace(root, rule=stopped_while_waiting_rule(catalog), rank=rank, ranks=(rank,),
                   confidence=min(root.confidence, 0.35), reasons=root.reasons + (
        f"no error, {took}and every rank's last line before it is " + why,))


def _one_rank_apart(scan: ScanResult, keys: list[StreamKey], stop: Finding, facts: RankFacts
                    ) -> tuple[int, str] | None:
    """The one rank whose last lines before the stop set it apart, and how they do (the end of the reason)."""
    rank = went_on_alone(scan, keys, stop.source, stop.line)
    if rank is not None:
        return rank, (f"its progress line at step {facts.last_step.get(rank)} but rank {rank}'s, which says what it "
                      "went on to do: the others waited for it, and the stop ended the wait")
    rank = fell_behind_alone(scan, keys, stop.source, stop.line)
    if rank is not None:
        return rank, (f"one same message after its progress at step {facts.last_step.get(rank)} but rank {rank}'s, "
                      "which is that progress line: the others went on and waited for it, and the stop ended the wait")
    rank = went_on_past_the_others(scan, keys, stop.source, stop.line, facts.known)
    if rank is not None:
        return rank, (f"one same message but rank {rank}'s, which reached that point too and then went on alone: the "
                      "others waited for it, and the stop ended the wait")
    rank = stopped_at_a_shared_line(scan, keys, stop.source, stop.line)
    if rank is not None:
        return rank, (f"one same message but rank {rank}'s, a line every other rank printed before theirs and went "
                      "on from: it stayed where the others passed, they waited for it, and the stop ended the wait")
    return None


def stopped_in_stride(scan: ScanResult, keys: list[StreamKey], root: RootCause, findings: list[Finding],
                      facts: RankFacts, catalog: Catalog) -> RootCause:
    """A SIGTERM to the launcher (a `timeout`, a time limit) with nothing failed, STARTUP_SECONDS or more after
    the job's start, when every rank had printed progress and none printed any after the stop: a live job's
    workers answer the SIGTERM the agent passes on (a handler's words, the step they finish), stuck ones are
    silent. The ranks had stopped moving before the stop came, and the stop ended a hang; with every rank's last
    line at one step, which rank stalled the log does not say, unless one rank alone last said it stopped early
    (`rank 1 early stop after trial 1`): it went its own way, and the others waited for it. Where no line before
    the stop is stamped as it is, every rank's progress having moved past its first step says start-up was over."""
    stop = root.finding
    if (not _signalled_stop_alone(root, findings) or stop.stamp is None or stop.source >= len(scan.sources)
            or len(facts.known) < 2 or not facts.known <= facts.last_step.keys()
            or not any((m := _STOPPED_BY.search(f.text)) and (m.group(1) or m.group(2)) in _TERMINATION
                       for f in findings if f.category is Category.EXTERNAL_STOP and f.source == stop.source)):
        return root
    if any(source != stop.source or last >= stop.line for source, _, last, _ in facts.last_progress.values()):
        return root
    ran = _seconds_before_stop(scan, stop)
    # (no line before the stop stamped as it is, `accelerate launch` or an OMP_NUM_THREADS set: its time is unknown,
    # and every rank's progress past its first step says start-up was over)
    if (ran is None and not _every_rank_stepped_on(scan, facts)) or (ran is not None and ran < STARTUP_SECONDS):
        return root
    early = [(rank, text) for rank, (_, text) in last_worker_lines(scan, keys, stop.source, stop.line)[1].items()
             if STOPPED_EARLY.search(text)]
    rank, said = early[0] if len(early) == 1 else (None, "")
    return replace(root, rule=stopped_while_waiting_rule(catalog), rank=rank, ranks=(rank,) if rank is not None
                   else (), confidence=min(root.confidence, 0.3), reasons=root.reasons + (
        ("a SIGTERM to the launcher " + (f"{ran:.0f} s after the job's start" if ran is not None else "after every "
         "rank had stepped on from its first progress line") + ", nothing failed, every rank had printed progress "
        "and no rank printed any after the stop (a live job's workers answer the SIGTERM passed on to them): the "
        "ranks had stopped moving before the stop came, and the stop ended that hang"),) + ((
            f"rank {rank}'s last line says it stopped early (`{said[:120]}`): it left the others' path, and they "
            "waited for it",) if rank is not None else ()))


def _every_rank_stepped_on(scan: ScanResult, facts: RankFacts) -> bool:
    """Every rank's last progress line names a later step than its first one (not heartbeats at one step)."""
    firsts: dict[int, list[tuple[int, str]]] = {}
    for source, first, last, text in facts.last_progress.values():
        if first >= last or source >= len(scan.sources):
            return False
        firsts.setdefault(source, []).append((first, text))
    for source, ranks in firsts.items():
        lines = read_lines(scan.sources[source], scan.indexes[source], sorted({first for first, _ in ranks}))
        for first, text in ranks:
            begun, reached = step_number(lines.get(first, "")), step_number(text)
            if begun is None or reached is None or begun >= reached:
                return False
    return bool(firsts)


def _workers_stopped(findings: list[Finding], source: int) -> int:
    """How many worker processes the launcher stopped by pid in that source (`Sending process N closing signal`)."""
    return sum(f.rule.id == TEARDOWN_RULE and f.source == source for f in findings)


def _seconds_before_stop(scan: ScanResult, stop: Finding) -> float | None:
    """Seconds from the first line of the input stamped like the stop (the launcher's start) to the stop."""
    head = read_lines(scan.sources[stop.source], scan.indexes[stop.source], list(range(1, min(stop.line, 40))))
    begun = next((s for n in sorted(head) if (s := parse_stamp(head[n])) is not None
                  and s.family == stop.stamp.family), None)
    return None if begun is None else stop.stamp.seconds - begun.seconds


UNEVEN_STEPS = 2   # progress this many steps apart between ranks when the stop came: they no longer moved together


def stopped_with_uneven_progress(scan: ScanResult, root: RootCause, findings: list[Finding], facts: RankFacts,
                                 catalog: Catalog) -> RootCause:
    """An external stop (SIGTERM, Ctrl-C) with nothing failed, when every rank printed progress and
    their last steps lie UNEVEN_STEPS or more apart: ranks that train together in lockstep had
    stopped moving together, some waiting in a collective the others no longer called. The stop
    ended that hang; the one rank whose step differs from all the others' went its own way."""
    steps = facts.last_step
    if (not _signalled_stop_alone(root, findings) or len(facts.known) < 2 or not facts.known <= steps.keys()
            or max(steps.values()) - min(steps.values()) < UNEVEN_STEPS):
        return root
    rule = stopped_while_waiting_rule(catalog)
    hung = replace(root, rule=rule, rank=None, ranks=(), confidence=min(root.confidence, 0.4), reasons=root.reasons + (
        f"no error, and the ranks' last progress lines lie {max(steps.values()) - min(steps.values())} steps apart "
        f"(steps {min(steps.values())} to {max(steps.values())}) when the stop came: they had stopped moving together, "
        "and the stop ended the wait",))
    return at_the_odd_step(hung, facts, 0.4, (
        "rank {rank}'s last progress line is step {step}, every other rank's step {others}: it went its own way "
        "(a collective skipped or added), and the others waited for it"))


def _signalled_stop_alone(root: RootCause, findings: list[Finding]) -> bool:
    """The root is an external stop by SIGTERM or SIGINT (the launcher's own words for it), and nothing
    in the log failed apart from the stop."""
    stop = root.finding
    return (root.rule.category is Category.EXTERNAL_STOP and stop is not None
            and any(_STOPPED_BY.search(f.text) for f in findings
                    if f.category is Category.EXTERNAL_STOP and f.source == stop.source)
            and not any(f.fails_beyond_a_stop for f in findings))
