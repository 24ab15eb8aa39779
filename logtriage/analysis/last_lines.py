"""The lines each rank printed last before a point in the log (a stop, a failure): what the window
before it holds, rank by rank, and the one rank whose last lines set it apart from all the others, one
that went on alone, fell behind alone, or was still at work after the others fell silent."""

from __future__ import annotations

import re

from logtriage.analysis.findings import mask_numbers
from logtriage.analysis.rank_evidence import odd_one_out
from logtriage.analysis.stopped import message_of
from logtriage.demux.line_marks import find_rank_marker
from logtriage.demux.split import split_glued
from logtriage.demux.streams import StreamKey, StreamKind
from logtriage.ingest.lines import read_lines
from logtriage.scan_result import ScanResult, step_number

WINDOW = 160          # lines read back before the stop
_WORKER_KINDS = frozenset({StreamKind.RANK, StreamKind.UNATTRIBUTED})
# a worker's own words that it waits (`waiting for the data cache /data/cache/READY`, `waits on the lock`)
WAITING_WORDS = re.compile(r"\bwaiting\b|\bwaits? (?:for|on|until)\b", re.IGNORECASE)
LastLine = tuple[int, str]   # (line number, message)


def ranked_pieces(scan: ScanResult, keys: list[StreamKey], source: int, end: int):
    """(rank, message) for each rank's message in the WINDOW lines before line `end`."""
    for _, _, rank, piece in pieces_before(scan, keys, source, end):
        if rank is not None:
            yield rank, piece


def pieces_before(scan: ScanResult, keys: list[StreamKey], source: int, end: int, after: int = 0):
    """(line, stream, rank, message) for each message in the WINDOW lines before line `end` (and the
    `after` lines from it on): its rank is the line's own stream's, or the one its text names (None
    for neither); two ranks' messages glued on one line are two."""
    index = scan.indexes[source]
    numbers = list(range(max(1, end - WINDOW), end + after))
    texts = read_lines(scan.sources[source], index, numbers)
    for number in numbers:
        if number - 1 >= len(index.slots):
            break
        key = keys[scan.slots.final(index.slots[number - 1])]
        own = key.rank if key.kind is StreamKind.RANK else None
        for piece in split_glued(message_of(texts.get(number, ""))):
            marked = find_rank_marker(piece)
            yield number, key, own if marked is None else marked, piece


def last_worker_lines(scan: ScanResult, keys: list[StreamKey], source: int,
                      end: int) -> tuple[LastLine | None, dict[int, LastLine]]:
    """The last worker message before line `end` (a rank's or one no stream claims), and each rank's."""
    last: LastLine | None = None
    by_rank: dict[int, LastLine] = {}
    for number, key, rank, piece in pieces_before(scan, keys, source, end):
        if key.kind in _WORKER_KINDS and piece.strip():
            last = (number, piece.strip())
            if rank is not None:
                by_rank[rank] = last
    return last, by_rank


def _last_lines(scan: ScanResult, keys: list[StreamKey], source: int, end: int
                ) -> tuple[dict[int, tuple[int | None, str]], dict[int, int]]:
    """Each rank's last line before `end` (its step, None for a line that is not progress, and the line with
    its numbers masked), and the step of each rank's last progress line. A line of a rank other than 0 that
    names a step in a shape no other rank printed, after progress lines of another shape, is what it went on to
    do, not progress (`rank 2 writing validation images for step 3` after `rank 2 step 2 loss 0.50`); rank 0's
    lines of its own are the summaries a program logs on rank 0 only."""
    pieces = []   # (rank, the line, its step or None, its shape where it has a step)
    printed_by: dict[str, set[int]] = {}
    for rank, piece in ranked_pieces(scan, keys, source, end):
        if piece.strip():
            step = step_number(piece)
            shape = mask_numbers(piece).strip() if step is not None else ""
            if step is not None:
                printed_by.setdefault(shape, set()).add(rank)
            pieces.append((rank, piece, step, shape))
    last: dict[int, tuple[int | None, str]] = {}
    steps: dict[int, int] = {}
    shapes: dict[int, set[str]] = {}
    for rank, piece, step, shape in pieces:
        if step is not None:
            seen = shapes.setdefault(rank, set())
            if rank != 0 and seen and shape not in seen and printed_by[shape] == {rank}:
                step = None
            seen.add(shape)
        last[rank] = (step, piece)
        if step is not None:
            steps[rank] = step
    return last, steps


def went_on_alone(scan: ScanResult, keys: list[StreamKey], source: int, end: int) -> int | None:
    """The one rank whose last line before `end` is not a progress line, where every other rank's
    last line is one, all at one step, and that rank's last progress was at that step or before it
    (`rank 2: approx KL ... stopping updates; running evaluation episodes` after its step 5, the others
    at step 6: it left the loop the others stayed in)."""
    last, steps = _last_lines(scan, keys, source, end)
    went_on = [r for r, (step, _) in last.items() if step is None]
    if len(last) < 2 or len(went_on) != 1 or set(steps) != set(last):
        return None
    others = {step for r, step in steps.items() if r != went_on[0]}
    return went_on[0] if len(others) == 1 and steps[went_on[0]] <= min(others) else None


def went_on_past_the_others(scan: ScanResult, keys: list[StreamKey], source: int, end: int,
                            workers: frozenset[int]) -> int | None:
    """The one rank other than 0 that printed the line every other rank ended on (numbers aside) and then
    went on alone (`rank 2: writing reconstruction grid ...` after its `rank 2: eval PSNR ...`, where ranks 0
    and 1 last said `eval PSNR`), or that reached the step they all last reached and then said what no other
    rank said: the others had reached the next collective and waited there for it. (Rank 0 going on alone is a
    program that logs more on rank 0.)"""
    said: dict[int, list[str]] = {}
    last: dict[int, str] = {}
    steps: dict[int, int] = {}
    for rank, piece in ranked_pieces(scan, keys, source, end):
        if piece.strip():
            said.setdefault(rank, []).append(mask_numbers(piece).strip())
            last[rank] = piece
            if (step := step_number(piece)) is not None:
                steps[rank] = step
    if len(said) < 3 or said.keys() != workers:
        return None
    odd = odd_one_out({rank: texts[-1] for rank, texts in said.items()})
    if odd is None or odd == 0 or step_number(last[odd]) is not None:   # (its own progress is no going on)
        return None
    if odd in steps and any(step < steps[odd] for rank, step in steps.items() if rank != odd):
        return None     # (a step past another rank's: it did not leave the loop before them)
    shared = next(texts[-1] for rank, texts in said.items() if rank != odd)
    if shared in said[odd][:-1]:
        return odd
    # (or it reached the last step every other rank reached, and its last line is one no other rank printed:
    # `rank 2: rendering preview sample ...` after its step 5, the others' `preview next event: note_on 48`)
    others = {step for rank, step in steps.items() if rank != odd}
    opening = _opening(said[odd][-1])   # (by its first words: `preview next event: time_shift #` is the others' line)
    alone = not any(_opening(text) == opening for rank, texts in said.items() if rank != odd for text in texts)
    return odd if alone and len(others) == 1 and steps.get(odd) in others else None


def _opening(text: str) -> str:
    return " ".join(text.split()[:3])


def fell_behind_alone(scan: ScanResult, keys: list[StreamKey], source: int, end: int) -> int | None:
    """The one rank whose last line before `end` is its progress line, where every other rank's last
    line is one same message (numbers aside) after its progress at that same step (`rank 0 eval: 4
    images`): the others went on from that step together, and it did not."""
    last, steps = _last_lines(scan, keys, source, end)
    behind = [r for r, (step, _) in last.items() if step is not None]
    if len(last) < 3 or len(behind) != 1 or set(steps) != set(last) or len(set(steps.values())) != 1:
        return None
    went_on = {mask_numbers(piece).strip() for r, (_, piece) in last.items() if r != behind[0]}
    return behind[0] if len(went_on) == 1 else None


def stopped_at_a_shared_line(scan: ScanResult, keys: list[StreamKey], source: int, end: int) -> int | None:
    """The one rank whose last line (numbers aside) every other rank printed too and went on from, to one same
    last line that rank never printed (`rank 2: sliding-window validation, window 12, stride 1`, where ranks 0, 1
    and 3 said `... stride 12` and then `rank N: 64 windows in 0.9s`): it stayed where they all passed."""
    said: dict[int, list[str]] = {}
    for rank, piece in ranked_pieces(scan, keys, source, end):
        if piece.strip():
            said.setdefault(rank, []).append(mask_numbers(piece).strip())
    if len(said) < 3:
        return None
    ends = {rank: texts[-1] for rank, texts in said.items()}
    rank = odd_one_out(ends)
    if rank is None:
        return None
    others = [texts for r, texts in said.items() if r != rank]
    shared = others[0][-1]
    passed = all(ends[rank] in texts[:-1] for texts in others)
    return rank if passed and shared not in said[rank] else None


def at_work_alone(scan: ScanResult, keys: list[StreamKey], source: int, end: int, workers: int) -> int | None:
    """In a start-up stopped from outside (no rank printed a step): the one rank that went on printing what it
    did after every other rank fell silent (`rank 2: recomputing the teacher logits`, `teacher logits 32/96`), or,
    of `workers` processes, the one rank other than 0 that printed anything at all (`rank 2: loading warm-start
    tables ...`): the silent ranks waited for it. (Rank 0 alone speaking is a program that logs on rank 0 only.)
    Two lines or more after the others fell silent, one at least that no other rank printed, numbers aside: a late
    start-up line every rank printed (DDP's warning, `rank 1/4 pid 11272 ...` as the others' `rank N/4 pid ...`)
    is no work of its own, and rank 0's lines of its own on its way to the last line every rank printed, numbers
    aside, are a program that logs more on rank 0."""
    last: dict[int, int] = {}
    lines: dict[int, list[tuple[int, str]]] = {}
    for number, _, rank, piece in pieces_before(scan, keys, source, end):
        if rank is not None and piece.strip():
            last[rank] = number
            lines.setdefault(rank, []).append((number, mask_numbers(piece).strip()))
    if not last:
        return None
    rank = max(last, key=last.get)
    if len(last) == 1:
        return rank if rank != 0 and workers >= 2 else None
    if rank == 0 and len({texts[-1][1] for texts in lines.values()}) == 1:
        return None     # (rank 0 logging more on its way to the point where every rank's last line is the same)
    others = max(n for r, n in last.items() if r != rank)
    said = {text for r, texts in lines.items() if r != rank for _, text in texts}
    late = [text for n, text in lines[rank] if n > others]
    return rank if workers >= 3 and len(late) >= 2 and any(text not in said for text in late) else None


# a traceback's own lines (its header, frames, source lines and carets are indented or start so)
_TRACEBACK_PART = re.compile(r"^(?:\s|Traceback \(most recent call last\)|\^|$)")


def at_work_after_the_timeouts(scan: ScanResult, keys: list[StreamKey], first_wait: int,
                               lost: dict[int, tuple[int, int]]) -> int | None:
    """Of the ranks that did not time out but lost their peers (`lost`: rank -> (source, first line of its
    traceback)), the one that printed a line of its own work after the first rank's timeout began (`first_wait`,
    the first line of its traceback) and before its own traceback (`rank 2 BPE done: 5072760 merges`): it was
    still at work when the others gave up, so it came to the collective late. Two such ranks say nothing."""
    late = set()
    for rank, (source, start) in lost.items():
        if start <= first_wait:
            continue
        for number, _, owner, piece in pieces_before(scan, keys, source, start):
            if first_wait < number and owner == rank and not _TRACEBACK_PART.match(piece):
                late.add(rank)
                break
    return next(iter(late)) if len(late) == 1 else None
