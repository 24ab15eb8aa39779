"""Rows of a hard-wrapped paste joined back into the lines the program printed.

A terminal (or a multiplexer's copy mode, a fixed-width viewer) cuts every line longer than its
width into rows of exactly that width; pasted, each row is a line of its own, and the rows after
the first lose the line's prefix (`[rank1]: `) and half of its message. A log shows the width
when its longest lines are many, all of one length, and differ in more than their numbers
(`Dialect.wrap_width`); a row of that length then continues on the next row, unless the next row
starts a record of its own: a label the demuxer reads (`Dialect.labelled`: a rank's, a tee's,
srun's, Open MPI's), a log header, a traceback's start.

The joined line keeps every physical row: each row's offset and slot are indexed (conservation
counts rows), and the line is numbered by its first row."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

MIN_WIDTH = 60
MAX_WIDTH = 1000
_DIGITS = re.compile(r"\d+")
# a row that begins a record of its own, not the rest of the row before it (besides the labels the
# demuxer reads, which the caller's `labelled` tells)
_RECORD_START = re.compile(r"^(?:[IWEF]\d{4} \d\d:\d\d|Traceback \(|  File \"|\[?\d{4}-\d\d-\d\d[ T]\d\d:|frame #\d|"
                           r"Exception raised from |terminate called )")


def wrap_width(lines: Iterable[str], labelled: Callable[[str], bool]) -> int:
    """The width a paste was hard-wrapped at, or 0: its longest lines (at least 60 characters)
    are three or more, one in twenty at least, differ in more than their digits, and at least half
    of them go on in the next row (a terminal that cuts lines off, frames that are records of their
    own, show none). Rows that end in blanks or a box's edge are whole lines a layout padded to
    its width (a rich traceback's box, a multiplexer's copy), not cut ones."""
    lines = [line for line in lines if line.strip()]
    if not lines:
        return 0
    top = max(len(line) for line in lines)
    if not MIN_WIDTH <= top <= MAX_WIDTH:
        return 0
    cut = [i for i, line in enumerate(lines) if len(line) == top and not padded(line)]
    if len(cut) < 3 or len(cut) * 20 < len(lines):
        return 0
    if len({_DIGITS.sub("#", lines[i]) for i in cut}) < 3:
        return 0
    followed = [i for i in cut if i + 1 < len(lines)]
    going_on = sum(1 for i in followed if continues(lines[i + 1], labelled))
    return top if going_on * 2 >= len(followed) else 0


def padded(row: str) -> bool:
    """A row that ends in a blank, `|` or a box-drawing character (U+2500-U+257F) is a whole line
    laid out to the width."""
    last = row[-1:]
    return last.isspace() or last == "|" or "\u2500" <= last <= "\u257f"


def continues(row: str, labelled: Callable[[str], bool]) -> bool:
    return bool(row.strip()) and not _RECORD_START.match(row) and not labelled(row)


class RowJoiner:
    """Feed rows in order; get back the logical lines they complete as (numbers, offsets, text)."""

    def __init__(self, width: int, labelled: Callable[[str], bool]):
        self.width, self.labelled = width, labelled
        self.rows: list[tuple[int, int, str]] = []

    def push(self, number: int, offset: int, row: str) -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
        done = []
        if self.rows and not continues(row, self.labelled):
            done.append(self._joined())
        self.rows.append((number, offset, row))
        if len(row) != self.width or padded(row):
            done.append(self._joined())
        return done

    def flush(self) -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
        return [self._joined()] if self.rows else []

    def _joined(self) -> tuple[tuple[int, ...], tuple[int, ...], str]:
        rows, self.rows = self.rows, []
        return tuple(r[0] for r in rows), tuple(r[1] for r in rows), "".join(r[2] for r in rows)
