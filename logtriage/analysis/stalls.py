"""Stalls a program's own progress reports show: heartbeat lines that kept coming while the step
did not advance, up to the moment someone stopped the job (the seed's DDP rules: a heartbeat per
rank, and a watchdog that turns a silent hang into an exit); and a watchdog that fired on every
rank but one, the one the others were waiting for."""

from __future__ import annotations

import re
from dataclasses import replace

from logtriage.analysis.findings import Finding, mask_numbers
from logtriage.analysis.hangs import BEHIND_STEPS
from logtriage.analysis.last_lines import (WAITING_WORDS, WINDOW, at_work_after_the_timeouts, last_worker_lines,
                                          pieces_before, ranked_pieces, went_on_alone, went_on_past_the_others)
from logtriage.analysis.odd_start import odd_line_out
from logtriage.analysis.rank_evidence import odd_one_out
from logtriage.analysis.refine import at_the_odd_step, stopped_while_waiting_rule
from logtriage.analysis.roots import RankFacts, RootCause
from logtriage.analysis.rule_readings import SPAWN_RULES
from logtriage.analysis.signal_readings import TEARDOWN_RULE
from logtriage.catalog.loader import Catalog
from logtriage.catalog.rule import Category
from logtriage.demux.streams import StreamKey, StreamKind
from logtriage.rank_ranges import ranges
from logtriage.scan_result import ScanResult, step_number

REPEATS = 3           # heartbeats at one step that make a stall
WATCHDOG_RULE = "hang.watchdog_heartbeat"


def heartbeats_before_stop(scan: ScanResult, keys: list[StreamKey], root: RootCause, findings: list[Finding],
                           catalog: Catalog) -> RootCause:
    """A job stopped from outside (Ctrl-C, a scheduler's or a `timeout`'s SIGTERM) whose ranks'
    last lines before the stop repeat one message at one step, again and again: their heartbeats
    went on, their steps did not, so the stop ended a hang. The rank whose heartbeat says something
    else than all the others' (`phase data` where they say `phase backward`) is the one they wait for."""
    stop = root.finding
    if stop is None or stop.source >= len(scan.sources):
        return root
    end = min((f.line for f in findings if f.source == stop.source and (f.is_error or f.is_teardown)),
              default=stop.line)
    beats = _progress_before(scan, keys, stop.source, end)
    stalled = {rank: texts for rank, texts in beats.items() if _repeats_at_one_step(texts)}
    moving = [rank for rank, texts in beats.items() if rank not in stalled and len(texts) >= 2]
    silent = _fell_silent(beats, stalled, moving)
    if not stalled or (moving and silent is None):
        return root
    step = max(texts[-1][0] for texts in stalled.values())
    rank, why = _odd_heartbeat(stalled) if silent is None else silent
    rule = stopped_while_waiting_rule(catalog)
    reasons = root.reasons + (
        f"before the stop, the last lines of rank(s) {ranges(sorted(stalled), limit=8)} repeat one message at step "
        f"{step} ({REPEATS} or more times): heartbeats went on while the steps did not, so the job had stalled, and "
        "the stop only ended the hang",) + ((why,) if why else ())
    return replace(root, rule=rule, rank=rank, ranks=(rank,) if rank is not None else tuple(sorted(stalled)),
                   confidence=min(root.confidence, 0.45), reasons=reasons)


def time_limit_ended_hang(scan: ScanResult, keys: list[StreamKey], root: RootCause,
                          findings: list[Finding]) -> RootCause:
    """A job stopped from outside where the log also says the stop was a time limit's (`timeout`'s
    exit status 124, its `--verbose` notice, a wrapper's words for it): the run was still going when
    the limit ran out, so it hung, and the limit only ended it. Where every rank's last lines are its
    progress lines but one rank's, which said what it went on to do, that rank is where the others wait."""
    limit = next((f for f in findings if f.rule.stuck), None)
    stop = root.finding
    if root.rule.category is not Category.EXTERNAL_STOP or limit is None:
        return root
    rank = None
    if stop is not None and stop.source < len(scan.sources):
        # (under `--tee` the workers' last lines can come after the launcher's own stop lines)
        end = max(stop.line, limit.line) if limit.source == stop.source else stop.line
        rank = went_on_alone(scan, keys, stop.source, end)
    reasons = (f"the stop was a time limit's ({limit.text.strip()[:120]}): the run was still going when it ran "
               "out, stuck, and the limit only ended it",)
    if rank is not None:
        reasons += (f"every rank's last line before the stop is its progress line but rank {rank}'s, which says "
                    "what it went on to do: the others waited for it there",)
    return RootCause(limit.rule, limit, rank, (rank,) if rank is not None else (), min(root.confidence, 0.5),
                     reasons)


def late_rank_went_on(scan: ScanResult, keys: list[StreamKey], root: RootCause, findings: list[Finding]) -> RootCause:
    """A collective timeout no rank is missing from, or output that just stops, under a launcher that stops
    no one (a hand-made loop, mp.spawn): the late rank was not killed, so it timed out too late to be missing,
    or lost its connection when it came. Its own last words before the first traceback (or the end) say it
    went on to something else while every other rank's last line is its progress at one step (`rank 1:
    threshold drifted, rescanning full sensor history`); before a timeout it did not share, also words that
    differ from every other rank's, which agree. Rank 0 saying more than the others where the output stops
    is a program that logs its summaries there (`saved ckpt/model.pt`), not a rank gone elsewhere, unless that
    line says it waits (`rank 0 waiting for render lock ...`)."""
    timeout = root.rule.category is Category.COLLECTIVE_TIMEOUT
    if root.rank is not None or root.finding is None or not (timeout or root.rule.category is Category.HANG) \
            or any(f.rule.id == TEARDOWN_RULE for f in findings):
        return root
    source = root.finding.source
    if timeout:
        starts = [scan.blocks[f.block_id][1] for f in findings if f.is_error and f.source == source
                  and f.block_id in scan.blocks]
        end = min(starts + [root.finding.line])
    else:
        end = len(scan.indexes[source].offsets) + 1
    rank = went_on_alone(scan, keys, source, end)
    if rank is None and timeout:
        _, by_rank = last_worker_lines(scan, keys, source, end)
        rank = odd_line_out({r: text for r, (_, text) in by_rank.items()})
    elif rank is None:   # (`rank 2: rebuilding the interaction history ...` after its `loaded ...`, the others' last)
        workers = frozenset(k.rank for k in keys if k.kind is StreamKind.RANK and k.rank >= 0)   # (-1: no known rank)
        rank = went_on_past_the_others(scan, keys, source, end, workers)
    summary = not timeout and rank == 0 and not _says_it_waits(scan, keys, source, end, 0)   # rank 0 logs for all
    if rank is None or summary or (timeout and any(
            f.rank == rank and f.category is Category.COLLECTIVE_TIMEOUT for f in findings if f.is_error)):
        return root
    return replace(root, rank=rank, ranks=(rank,), reasons=root.reasons + (
        f"rank {rank}'s own last line before {'the first traceback' if timeout else 'the output stops'} says it "
        "went on to something else, or says other than every other rank's: the others waited for it there",))


def _says_it_waits(scan: ScanResult, keys: list[StreamKey], source: int, end: int, rank: int) -> bool:
    """The rank's own last line before `end` says it waits (`rank 0 waiting for render lock ...`): rank 0 gone
    on alone to a wait of its own is where the job stuck, not a summary it logs for every rank."""
    said = last_worker_lines(scan, keys, source, end)[1].get(rank)
    return said is not None and WAITING_WORDS.search(said[1]) is not None


def came_late_to_the_collective(scan: ScanResult, keys: list[StreamKey], root: RootCause,
                                findings: list[Finding], steps: dict[int, int]) -> RootCause:
    """A collective timeout whose rank is unknown or one that timed out itself (a waiter): of the ranks that
    did not time out but lost their peers, the one that printed its own work between the first timeout's
    traceback and its own traceback was still at work when the others gave up (`at_work_after_the_timeouts`).
    Where several ranks never joined, the one of them whose last line before the first traceback says it went
    on to other work after its last step (`rank 1 filtering negatives against 96 known quadruples`), the
    waiting ranks' last lines being that step's progress, was the one they waited for. `steps`: each rank's
    last step."""
    if root.finding is None or root.rule.category is not Category.COLLECTIVE_TIMEOUT:
        return root
    errors = [f for f in findings if f.is_error and f.rank is not None and f.block_id in scan.blocks]
    waits = [f for f in errors if f.category is Category.COLLECTIVE_TIMEOUT]
    timed_out = {f.rank for f in waits}
    if not waits or (root.rank is not None and root.rank not in timed_out):
        return root
    first = min(waits, key=lambda f: (f.source, scan.blocks[f.block_id][1]))
    began = scan.blocks[first.block_id][1]
    lost: dict[int, tuple[int, int]] = {}
    for f in errors:
        if f.category is Category.COLLECTIVE_ERROR and f.rank not in timed_out and f.source == first.source:
            start = scan.blocks[f.block_id][1]
            lost[f.rank] = min(lost.get(f.rank, (f.source, start)), (f.source, start))
    rank = at_work_after_the_timeouts(scan, keys, began, lost)
    # the waiting ranks: the root's, where an earlier reading named them (a rank that timed out later, in a
    # later collective, waited for something else), else every rank that timed out
    waiting = (set(root.ranks) & timed_out) or timed_out
    if rank is not None and steps.get(rank, -1) > max((steps.get(r, -1) for r in waiting), default=-1):
        rank = None     # it had printed a later step than any waiting rank: past their collective, not late to it
    if rank is not None:
        why = (f"rank {rank} did not time out: it printed its own work after rank {first.rank}'s timeout began and "
               "only then lost its peers, so it was still at work when the others gave up waiting for it")
    elif root.rank is None and len(root.ranks) >= 2:
        rank = went_on_alone(scan, keys, first.source, began)
        rank = rank if rank in root.ranks else None
        why = (f"of the ranks that never joined, rank {rank}'s last line before the first traceback says it went on "
               "to other work after its last step, where the waiting ranks' last lines are that step's progress")
    elif timed_out == {root.rank} and any(f.rule.id in SPAWN_RULES for f in findings):
        # mp.spawn's report holds the first child's error alone: the children hand their tracebacks to the
        # parent (they print none) and the parent terminates the rest once one has raised, so one rank's
        # timeout says nothing of where the others were; it may be the one that took another path, or one
        # of those that waited for it
        rank = went_on_alone(scan, keys, first.source, began)
        rank = rank if rank != root.rank else None
        why = (f"rank {rank}'s last line before the traceback says it went on to other work after its last step, "
               "where every other rank's last line is that step's progress: it is the rank the others waited for")
    if rank is None:
        return root
    return replace(root, rank=rank, ranks=(rank,), confidence=min(root.confidence, 0.5), reasons=root.reasons + (why,))


def heartbeat_odd_one_out(scan: ScanResult, keys: list[StreamKey], root: RootCause) -> RootCause:
    """A hang with no rank (the output just stops) whose ranks' last lines are heartbeats at one
    step: the rank whose heartbeat says something else than all the others' is the one they wait for."""
    if root.rank is not None or root.rule.category is not Category.HANG or not scan.sources:
        return root
    source = len(scan.sources) - 1
    beats = _progress_before(scan, keys, source, len(scan.indexes[source].offsets) + 1)
    stalled = {rank: texts for rank, texts in beats.items() if _repeats_at_one_step(texts)}
    if len(stalled) < 3 or any(rank not in stalled and len(texts) >= 2 for rank, texts in beats.items()):
        return root
    rank, why = _odd_heartbeat(stalled)
    if rank is None:
        return root
    return replace(root, rank=rank, ranks=(rank,), reasons=root.reasons + (why,))


def watchdog_spared_rank(root: RootCause, findings: list[Finding], facts: RankFacts) -> RootCause:
    """Progress watchdogs fired on every rank but one: the ranks whose steps stopped because they
    waited in a collective reported it, and the one rank they waited for (busy elsewhere, its own
    watchdog slower or absent) is where the stall is."""
    if root.rule.id != WATCHDOG_RULE:
        return root
    if root.finding is not None and root.finding.stream.kind is not StreamKind.RANK:
        return _dump_of_the_odd_rank(root, facts)
    fired = {f.rank for f in findings if f.rule.id == WATCHDOG_RULE and f.rank is not None}
    spared = facts.known - fired
    if len(fired) >= 2 and not spared:    # every rank's fired: their progress lines tell the stall
        return _dump_of_the_odd_rank(root, facts)
    if len(fired) < 2 or len(spared) != 1 or not facts.speaking >= spared:
        return root
    rank = next(iter(spared))
    return replace(root, rank=rank, ranks=(rank,), confidence=min(root.confidence, 0.45), reasons=root.reasons + (
        f"the watchdogs of ranks {ranges(sorted(fired), limit=8)} fired and rank {rank}'s did not: they saw no "
        f"progress because they waited for rank {rank}, which was busy elsewhere",))


def _dump_of_the_odd_rank(root: RootCause, facts: RankFacts) -> RootCause:
    """A watchdog's dump no line ties to a rank (faulthandler's `Timeout (0:00:10)!` and stacks), or
    watchdogs that fired on every rank: the rank whose progress lines stopped at another step than
    every other rank's is the stall."""
    return at_the_odd_step(root, facts, 0.4, (
        "the watchdog's output does not tell the stalled rank; rank {rank}'s last progress line is step {step} and "
        "every other rank's step {others}: rank {rank} went its own way, and the others waited for it"))


def _progress_before(scan: ScanResult, keys: list[StreamKey], source: int, end: int) -> dict[int, list]:
    """Each rank's progress messages (step, masked text, order in the window) in the WINDOW lines
    before line `end`."""
    beats: dict[int, list] = {}
    for order, (rank, piece) in enumerate(ranked_pieces(scan, keys, source, end)):
        step = step_number(piece)
        if step is not None:
            beats.setdefault(rank, []).append((step, mask_numbers(piece).strip(), order))
    return beats


def _fell_silent(beats: dict[int, list], stalled: dict[int, list], moving: list[int]) -> tuple[int, str] | None:
    """The one rank whose progress lines changed (it did not repeat one heartbeat) and then stopped
    before any other rank's repeating began: its heartbeat stopped with it (a loop that holds the
    GIL, a process stopped), while the others waited for it and went on beating."""
    if len(moving) != 1 or not stalled:
        return None
    rank = moving[0]
    repeating_from = min(_repeat_start(texts) for texts in stalled.values())
    last = beats[rank][-1]
    if last[2] >= repeating_from:
        return None
    return rank, (f"rank {rank}'s last progress line (`{last[1]}`, step {last[0]}) came before the others began "
                  f"repeating theirs, and it printed nothing after: it stopped there, heartbeat and all, and the others "
                  f"waited for it")


def _repeat_start(texts: list) -> int:
    """Where the run of identical messages at the end of one rank's progress lines begins."""
    start = len(texts) - 1
    while start > 0 and texts[start - 1][1] == texts[-1][1]:
        start -= 1
    return texts[start][2]


def _repeats_at_one_step(texts: list[tuple[int, str]]) -> bool:
    last = texts[-REPEATS:]
    return len(last) == REPEATS and len({t[:2] for t in last}) == 1


def _odd_heartbeat(stalled: dict[int, list]) -> tuple[int | None, str]:
    if len(stalled) == 1:
        return next(iter(stalled)), ""
    said = {rank: texts[-1][1] for rank, texts in stalled.items()}
    rank = odd_one_out(said)
    if rank is None:
        return None, ""
    common = next(text for r, text in said.items() if r != rank)
    return rank, (f"rank {rank}'s heartbeat (`{said[rank]}`) differs from every other rank's (`{common}`): "
                  f"the others waited for rank {rank}")


NO_PROGRESS_RULE = "hang.no_progress"
# a rank's last words after its last step: it left its loop by design (a shorter shard under a Join
# context manager, an early stop it announced), not stuck: `rank 3 joined after 5 steps`, `rank 3 done`
_ENDED_ITS_LOOP = re.compile(r"\b(?:done|finished|completed?|joined|exiting)\b", re.IGNORECASE)


def behind_ranks_ended(scan: ScanResult, keys: list[StreamKey], root: RootCause | None,
                       facts: RankFacts) -> RootCause | None:
    """A hang read from uneven progress (hang.no_progress) is none when each rank behind said, in its
    last line after its last progress line, that it was done: it ended its loop on purpose; or when its
    later progress lines were glued onto other ranks' (`rank 3 step 5 loss 0.74rank 2 step 5 loss 0.74`:
    processes that share one console unprefixed), which gave the whole line to the rank it starts with."""
    if root is None or root.rule.id != NO_PROGRESS_RULE or not root.ranks:
        return root
    high = max(facts.last_step.values())
    for rank in root.ranks:
        span = next((s for k, s in facts.last_progress.items() if k.kind is StreamKind.RANK and k.rank == rank), None)
        if span is None:
            return root
        source, _, last, _ = span
        said = [piece for number, _, who, piece in pieces_before(scan, keys, source, last + WINDOW)
                if number > last and who == rank and piece.strip()]
        glued_steps = [s for s in map(step_number, said) if s is not None]
        if glued_steps and high - max(glued_steps) < BEHIND_STEPS:
            continue
        if not said or not _ENDED_ITS_LOOP.search(said[-1]):
            return root
    return None
