"""Ranks whose clocks disagree: one node's records stamped in another time zone (`TZ=Asia/Shanghai` on
one node, UTC on the other: the same instant eight hours apart) or by a clock that is minutes off.
Data-parallel ranks print the same step at nearly the same moment (its collectives hold them
together), so the steps two ranks both printed say how far one's clock is from the other's; a rank's
stamps are moved by that much onto the reference rank's clock before they order events across ranks."""

from __future__ import annotations

from dataclasses import replace
from statistics import median

from logtriage.analysis.record_stamps import stamp_of_line
from logtriage.analysis.timestamps import Stamp
from logtriage.demux.prefixes import Dialect, strip_prefixes
from logtriage.demux.streams import StreamKey, StreamKind
from logtriage.ingest.lines import read_lines
from logtriage.scan_result import ScanResult, step_number

MIN_OFFSET_S = 30.0     # smaller gaps are a slow rank or a step's own length, not a clock
AGREEMENT_S = 5.0       # every shared step must give the same offset, within this
MAX_RANKS = 512         # ranks read; a bigger log keeps its stamps as they are


def clock_offsets(scan: ScanResult, keys: list[StreamKey]) -> dict[int, tuple[str, float]]:
    """rank -> (stamp family, seconds its clock is ahead of the reference rank's), for the ranks
    whose clock is off by MIN_OFFSET_S or more; the reference is the lowest rank with stamped steps."""
    lines: dict[int, set[tuple[int, int]]] = {}
    for slot, stats in scan.stats.items():
        key = keys[scan.slots.final(slot)]
        if key.kind is StreamKind.RANK and key.rank >= 0:
            for where in (stats.first_step_line, stats.last_step_line):
                if where is not None:
                    lines.setdefault(key.rank, set()).add(where)
    if not 2 <= len(lines) <= MAX_RANKS:
        return {}
    by_source: dict[int, list[int]] = {}
    for wheres in lines.values():
        for source, number in wheres:
            by_source.setdefault(source, []).append(number)
    texts = {(source, n): text for source, numbers in by_source.items()
             for n, text in read_lines(scan.sources[source], scan.indexes[source], numbers).items()}
    steps: dict[int, dict[int, list[Stamp]]] = {}
    for rank, wheres in lines.items():
        for where in wheres:
            text = texts.get(where)
            stamp = stamp_of_line(text) if text else None
            step = step_number(strip_prefixes(text, Dialect()).text) if text else None
            if stamp is not None and step is not None:
                steps.setdefault(rank, {}).setdefault(step, []).append(stamp)
    families = {s.family for per_step in steps.values() for stamps in per_step.values() for s in stamps}
    if len(steps) < 2 or len(families) != 1:
        return {}
    family = families.pop()
    reference = min(steps)
    offsets: dict[int, tuple[str, float]] = {}
    for rank, per_step in steps.items():
        shared = sorted(per_step.keys() & steps[reference].keys())
        if rank == reference or len(shared) < 2:
            continue   # (one shared step cannot tell a clock from a rank that started late)
        gaps = [median(s.seconds for s in per_step[step]) - median(s.seconds for s in steps[reference][step])
                for step in shared]
        gap = median(gaps)
        if abs(gap) >= MIN_OFFSET_S and all(abs(g - gap) <= AGREEMENT_S for g in gaps):
            offsets[rank] = (family, gap)
    return offsets


def on_reference_clock(stamp: Stamp | None, rank: int | None, offsets: dict[int, tuple[str, float]]) -> Stamp | None:
    """A stamp of this rank's, moved onto the reference rank's clock."""
    if stamp is None or rank not in offsets:
        return stamp
    family, gap = offsets[rank]
    return replace(stamp, seconds=stamp.seconds - gap) if stamp.family == family else stamp
