"""What the streams say about each rank, gathered once for the analysis: lines and progress merged
over a rank's slots, the ranks known to exist, exit codes, who completed, each rank's last step."""

from __future__ import annotations

from logtriage.analysis.childfailed import ChildFailure
from logtriage.analysis.findings import Finding
from logtriage.analysis.roots import RankFacts
from logtriage.demux.streams import StreamKey, StreamKind
from logtriage.scan_result import ScanResult, SlotStats


def merge_stats(scan: ScanResult, keys: list[StreamKey]) -> dict[StreamKey, SlotStats]:
    merged: dict[StreamKey, SlotStats] = {}
    for slot, stats in scan.stats.items():
        key = keys[scan.slots.final(slot)]
        into = merged.setdefault(key, SlotStats())
        into.lines += stats.lines
        if stats.first_line and (into.first_line is None or stats.first_line < into.first_line):
            into.first_line = stats.first_line
        if stats.last_step_line and (into.last_step_line is None or stats.last_step_line > into.last_step_line):
            into.last_step, into.last_step_line, into.last_step_text = stats.last_step, stats.last_step_line, stats.last_step_text
        if stats.first_step_line and (into.first_step_line is None or stats.first_step_line < into.first_step_line):
            into.first_step_line = stats.first_step_line
    return merged


SHAPES_RULE = "context.process_shapes"   # accelerate's per-process shapes under a mismatch


def rank_facts(stats: dict[StreamKey, SlotStats], failures: list[ChildFailure], findings: list[Finding],
                world_size: int | None, stopped_pids: frozenset[int] = frozenset()) -> RankFacts:
    """`stopped_pids`: the worker processes an agent said it was sending a signal to (to stop them)."""
    speaking = {k.rank for k, s in stats.items() if k.kind is StreamKind.RANK and s.lines}
    known = set(speaking)
    known |= {f.rank for f in failures if f.rank is not None}
    known |= {f.rank for f in findings if f.rank is not None}
    if world_size and world_size <= 65536 and (not known or max(known) < world_size):
        known |= set(range(world_size))
    elif known and max(known) <= 65536:
        known |= set(range(max(known) + 1))   # ranks count from 0: the ones below a rank seen exist too
    exit_codes = {f.rank: f.exitcode for f in failures if f.rank is not None and f.exitcode is not None}
    completed: set[int] = set()
    if failures:
        failed = {f.rank for f in failures}
        errored = {f.rank for f in findings if f.is_error and not f.is_teardown}
        completed = known - failed - errored
        # an agent whose summary is not in the log (another node's) was still stopping that many
        # workers of its own: the ranks it never reported had not finished
        unreported = stopped_pids - {f.pid for f in failures if f.pid is not None}
        if completed and len(unreported) >= len(completed):
            completed = set()
    last_step: dict[int, int] = {}
    for key, s in stats.items():
        if key.kind is StreamKind.RANK and s.last_step is not None:
            last_step[key.rank] = s.last_step
    summary_root = next((f.rank for f in reversed(failures) if f.is_root_cause), None)
    shapes = {int(f.captures["process"]): f.captures["shape"] for f in findings
              if f.rule.id == SHAPES_RULE and f.captures.get("process", "").isdigit()}
    progress = {key: (s.last_step_line[0], (s.first_step_line or s.last_step_line)[1], s.last_step_line[1],
                      s.last_step_text)
                for key, s in stats.items() if key.kind is StreamKind.RANK and s.last_step_line is not None}
    progress_end: dict[int, int] = {}
    for s in stats.values():
        if s.last_step_line is not None:
            source, line = s.last_step_line
            progress_end[source] = max(progress_end.get(source, 0), line)
    return RankFacts(frozenset(known), exit_codes, frozenset(completed), last_step, summary_root, frozenset(speaking),
                     shapes, progress, progress_end)


def first_progress(stats: dict[StreamKey, SlotStats]) -> tuple[int, int] | None:
    """Where the earliest stream's last progress line is: before it, the run had started training."""
    lines = [s.last_step_line for s in stats.values() if s.last_step_line]
    return min(lines) if lines else None
