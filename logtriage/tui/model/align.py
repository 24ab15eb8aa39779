"""Lining two streams up side by side, and merging inputs by time.

Split view rows pair the lines of two streams that belong to the same training step (a line
belongs to the last step its stream announced: `step 812`, `iter 812`, `global_step=812`), so
rank 5's traceback at step 812 sits beside what rank 0 printed during step 812. Without step
lines on both sides, lines are ordered by their timestamps, and without those, by input order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from itertools import zip_longest
from typing import Callable

import numpy as np

from logtriage.analysis.timestamps import parse_stamp
from logtriage.scan_result import STEP as TEXT_STEP

# The step counters `triage` reads for a rank's last step (logtriage/scan.py), as the viewer needs
# them: on raw bytes, so lining up two 150,000-line ranks decodes no line that has no step.
STEP = re.compile(TEXT_STEP.pattern.encode(), TEXT_STEP.flags & ~re.UNICODE)
MAX_TIME_MERGE_LINES = 2_000_000
BLANK = -1


class Basis(str, Enum):
    STEP = "step"
    TIME = "time"
    INPUT = "input order"


@dataclass(frozen=True)
class SplitRows:
    left: np.ndarray       # gid per row, BLANK where that side has no line
    right: np.ndarray
    basis: Basis


def split_rows(left: np.ndarray, right: np.ndarray, raw_of: Callable[[int], bytes],
               text_of: Callable[[int], str]) -> SplitRows:
    """`raw_of(gid)`: the line's bytes; `text_of(gid)`: its display text (for timestamps)."""
    left_steps = _steps([raw_of(g) for g in left.tolist()])
    right_steps = _steps([raw_of(g) for g in right.tolist()])
    if _known(left_steps) and _known(right_steps):
        rows = _by_segments(left.tolist(), left_steps, right.tolist(), right_steps)
        return _rows(rows, Basis.STEP)
    left_times = _times([text_of(g) for g in left.tolist()])
    right_times = _times([text_of(g) for g in right.tolist()])
    if _known(left_times) and _known(right_times):
        return _rows(_interleave(left.tolist(), left_times, right.tolist(), right_times), Basis.TIME)
    left_order, right_order = [float(g) for g in left.tolist()], [float(g) for g in right.tolist()]
    return _rows(_interleave(left.tolist(), left_order, right.tolist(), right_order), Basis.INPUT)


def _known(values: list) -> bool:
    return any(v is not None and v >= 0 for v in values)


def _steps(lines: list[bytes]) -> list[int]:
    """The step each line belongs to (-1 before the first step line)."""
    current, out = -1, []
    for text in lines:
        if (b"tep" in text or b"ter" in text or b"TEP" in text or b"TER" in text or b"it " in text
                or b"it=" in text) \
                and len(text) < 2000:
            m = STEP.search(text)
            if m:
                current = int(m.group(m.lastindex))   # the one alternative's counter that matched
        out.append(current)
    return out


def _times(texts: list[str]) -> list[float]:
    """Each line's time: its own stamp, else the last one before it (-1 before the first)."""
    current, out = -1.0, []
    for text in texts:
        stamp = parse_stamp(text)
        if stamp is not None:
            current = stamp.seconds
        out.append(current)
    return out


def _segments(gids: list[int], keys: list[int]) -> list[tuple[int, list[int]]]:
    out: list[tuple[int, list[int]]] = []
    for gid, key in zip(gids, keys):
        if out and out[-1][0] == key:
            out[-1][1].append(gid)
        else:
            out.append((key, [gid]))
    return out


def _by_segments(left, left_keys, right, right_keys) -> list[tuple[int, int]]:
    """Step by step: the lines of one step on both sides, side by side, the shorter side padded."""
    a, b = _segments(left, left_keys), _segments(right, right_keys)
    rows: list[tuple[int, int]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        if j >= len(b) or (i < len(a) and a[i][0] < b[j][0]):
            rows += [(g, BLANK) for g in a[i][1]]
            i += 1
        elif i >= len(a) or b[j][0] < a[i][0]:
            rows += [(BLANK, g) for g in b[j][1]]
            j += 1
        else:
            rows += [(x, y) for x, y in zip_longest(a[i][1], b[j][1], fillvalue=BLANK)]
            i += 1
            j += 1
    return rows


def _interleave(left, left_keys, right, right_keys) -> list[tuple[int, int]]:
    """One line per row, whichever side's line comes first."""
    rows: list[tuple[int, int]] = []
    i = j = 0
    while i < len(left) or j < len(right):
        if j >= len(right) or (i < len(left) and left_keys[i] <= right_keys[j]):
            rows.append((left[i], BLANK))
            i += 1
        else:
            rows.append((BLANK, right[j]))
            j += 1
    return rows


def _rows(rows: list[tuple[int, int]], basis: Basis) -> SplitRows:
    if not rows:
        return SplitRows(np.empty(0, np.int64), np.empty(0, np.int64), basis)
    array = np.array(rows, np.int64)
    return SplitRows(array[:, 0].copy(), array[:, 1].copy(), basis)


def merge_by_time(bases: np.ndarray, text_of: Callable[[int], str],
                  cancelled: Callable[[], bool] = lambda: False) -> np.ndarray | None:
    """Every line of several inputs, ordered by timestamp (a line without one keeps the time of
    the line before it in its file; ties keep input order). None when there are too many lines
    or no timestamps, or when cancelled."""
    total = int(bases[-1])
    if len(bases) < 3 or total > MAX_TIME_MERGE_LINES:
        return None
    times = np.empty(total, np.float64)
    for start, end in zip(bases[:-1].tolist(), bases[1:].tolist()):
        if cancelled():
            return None
        values = _times([text_of(g) for g in range(start, end)])
        first = next((v for v in values if v >= 0), -1.0)
        times[start:end] = [first if v < 0 else v for v in values]
    if not (times >= 0).any():
        return None
    return np.lexsort((np.arange(total), times)).astype(np.int64)
