"""Walk a chunk's lines in order: plain runs are assigned in bulk, every other line goes through
the exact per-line path (LineScanner.line). The result is the straightforward scan's, line for
line: a plain line gets exactly the slot the bulk assignment gives it, and none of its
neighbours' treatment depends on it beyond the state `Assigner.after_plain_lines` restores."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from logtriage.fastscan.flags import CANDIDATE, INHERIT, NOT_PLAIN, STEP, STEP2
from logtriage.ingest.reader import MAX_LINE, TAIL, capped
from logtriage.scan import LineScanner
from logtriage.scan_result import SlotStats, note_step

LUT_RANKS = 1 << 20


@dataclass
class ChunkLines:
    """The kernel's per-line arrays for one chunk (offsets relative to the chunk)."""
    starts: np.ndarray     # int64
    messages: np.ndarray   # int32: message start relative to the line start
    ranks: np.ndarray      # int64: rank of the (first) part; -1 none; INHERIT for empty lines
    flags: np.ndarray      # uint8
    cuts: np.ndarray       # int32: where a glued second part starts (0: not glued)
    ranks2: np.ndarray     # int64: rank of the second part


class RankSlots:
    """rank -> slot for plain lines, as a lookup table (rank + 1 indexes it; -1 = unknown yet).
    Rebuilt when the output segment changes (a failed attempt), since slots depend on it."""

    def __init__(self, assigner):
        self.assigner = assigner
        self.segment = None
        self.table = np.full(1, -1, dtype=np.int64)

    def __call__(self, ranks: np.ndarray) -> np.ndarray:
        segment = self.assigner.facts.segment
        if segment != self.segment:
            self.segment, self.table = segment, np.full(1, -1, dtype=np.int64)
        if len(ranks) and (ranks.min() < -1 or ranks.max() >= LUT_RANKS):
            values, inverse = np.unique(ranks, return_inverse=True)
            lut = np.array([self._slot(int(r)) for r in values.tolist()], dtype=np.int64)
            return lut[inverse]
        top = int(ranks.max()) + 2 if len(ranks) else 1
        if top > len(self.table):
            grown = np.full(max(top, 2 * len(self.table)), -1, dtype=np.int64)
            grown[: len(self.table)] = self.table
            self.table = grown
        slots = self.table[ranks + 1]
        missing = slots < 0
        if missing.any():
            for r in np.unique(ranks[missing]).tolist():
                self.table[r + 1] = self._slot(int(r))
            slots = self.table[ranks + 1]
        return slots

    def _slot(self, rank: int) -> int:
        return self.assigner.slot_for_rank(None if rank < 0 else rank)


class ChunkMerger:
    """Merges the chunks of one source, in order, into its LineScanner."""

    def __init__(self, scanner: LineScanner):
        self.scanner = scanner
        self.lookup = RankSlots(scanner.assigner)

    def merge(self, data, base: int, first_number: int, lines: ChunkLines) -> None:
        n = len(lines.starts)
        if n == 0:
            return
        scanner, assigner = self.scanner, self.scanner.assigner
        starts = lines.starts
        ends = np.empty(n, dtype=np.int64)
        ends[:-1] = starts[1:] - 1
        ends[-1] = len(data) - 1 if data[-1:] == b"\n" else len(data)
        not_plain = (lines.flags & NOT_PLAIN) != 0
        slow = not_plain | ((lines.flags & CANDIDATE) != 0)   # a plain line a rule may match: matched
        slow[1:] |= not_plain[:-1]      # the line after a special one: it may settle a pending state
        slow[:-1] |= not_plain[1:]      # the line before one: it may open a block the special line continues
        slow[-1] = True                 # the next chunk's first line is not known here
        slow_at = np.flatnonzero(slow)
        slots = np.empty(n, dtype=np.int64)          # first-part slot of every line
        last_of = np.full(n, -1, dtype=np.int64)     # second-part slot of plain glued lines
        plain = np.zeros(n, dtype=bool)
        i = 0
        while i < n:
            if slow[i] or not assigner.idle:
                length = int(ends[i] - starts[i])
                if length <= MAX_LINE:
                    raw = bytes(data[starts[i]:ends[i]])
                else:   # an overlong line: read only what the exact path keeps of it
                    raw = capped(bytes(data[starts[i]:starts[i] + MAX_LINE]),
                                 bytes(data[max(starts[i] + MAX_LINE, ends[i] - TAIL):ends[i]]))
                slots[i] = scanner.line(first_number + i, base + int(starts[i]), raw,
                                        may_match=bool(lines.flags[i] & (CANDIDATE | NOT_PLAIN)), index=False)
                i += 1
                continue
            k = int(np.searchsorted(slow_at, i))
            j = self._before_a_suspended_owner(lines, i, int(slow_at[k]) if k < len(slow_at) else n)
            if j == i:   # a line of a stream whose traceback waits: the exact path resumes or ends it
                slow[i] = True
                continue
            self._plain_run(lines, i, j, slots, last_of)
            plain[i:j] = True
            i = j
        index = scanner.index
        index.offsets.frombytes((starts + base).astype(np.int64).tobytes())
        index.slots.frombytes(slots.astype(np.int32).tobytes())
        self._plain_stats(first_number, slots, plain)
        _progress_lines(scanner, data, first_number, lines, ends, np.where(plain, slots, -1), last_of)
        scanner.lines = first_number + n - 1

    def _before_a_suspended_owner(self, lines: ChunkLines, i: int, j: int) -> int:
        """The first line in [i, j) of a stream whose traceback another stream's lines interrupted (suspended
        before its exception line): a plain line of that stream ends it on the exact path, so it is no plain line
        here (`[default2]:rank 2/4 up` between rank 2's `Traceback` header and its frames). j when there is none."""
        suspended = self.scanner.assigner.suspended
        if not suspended:
            return j
        owners = np.fromiter(suspended, dtype=np.int64)
        ranks = lines.ranks[i:j]
        hit = np.isin(self.lookup(np.where(ranks == INHERIT, -1, ranks)), owners)
        glued = lines.cuts[i:j] > 0
        if glued.any():
            hit |= glued & np.isin(self.lookup(np.where(glued, lines.ranks2[i:j], -1)), owners)
        at = np.flatnonzero(hit)
        return i + int(at[0]) if len(at) else j

    def _plain_run(self, lines: ChunkLines, i: int, j: int, slots: np.ndarray, last_of: np.ndarray) -> None:
        scanner, assigner = self.scanner, self.scanner.assigner
        ranks = lines.ranks[i:j]
        glued = lines.cuts[i:j] > 0
        inherit = ranks == INHERIT
        first = self.lookup(np.where(inherit, -1, ranks))
        last = first.copy()
        if glued.any():
            last[glued] = self.lookup(lines.ranks2[i:j][glued])
            pieces = int(glued.sum())
            scanner.result.fragments += pieces
            scanner.result.seq += pieces
            last_of[i:j] = np.where(glued, last, -1)
        if inherit.any():
            # an empty line joins the stream of the last part of the non-empty line before it
            carrier = np.where(inherit, -1, np.arange(j - i))
            np.maximum.accumulate(carrier, out=carrier)
            first = np.where(inherit, np.where(carrier >= 0, last[np.maximum(carrier, 0)], assigner.last_slot), first)
            last = np.where(inherit, first, last)
            non_empty = np.flatnonzero(~inherit)
            if len(non_empty):
                assigner.after_plain_lines(int(last[non_empty[-1]]))
        else:
            assigner.after_plain_lines(int(last[-1]))
        slots[i:j] = first
        scanner.result.seq += j - i

    def _plain_stats(self, first_number: int, slots: np.ndarray, plain: np.ndarray) -> None:
        """Line counts and first lines of the plain lines, once per chunk (the exact path's lines
        counted themselves as they came)."""
        if not plain.any():
            return
        result, source = self.scanner.result, self.scanner.source.index
        chosen = slots[plain]
        counts = np.bincount(chosen)
        positions = None
        for slot in np.flatnonzero(counts).tolist():
            stats = result.stats.get(slot)
            if stats is None:
                stats = result.stats[slot] = SlotStats()
            stats.lines += int(counts[slot])
            if stats.first_line is not None and stats.first_line < (source, first_number):
                continue   # first seen in an earlier chunk
            if positions is None:
                positions = np.flatnonzero(plain)
            earliest = (source, first_number + int(positions[np.argmax(chosen == slot)]))
            if stats.first_line is None or stats.first_line > earliest:
                stats.first_line = earliest


def _progress_lines(scanner: LineScanner, data, first_number: int, lines: ChunkLines,
                    ends: np.ndarray, slot_of: np.ndarray, last_of: np.ndarray) -> None:
    """Each stream's last progress line among the chunk's plain lines, unless a later line of the
    exact path already set it (the exact path records every one in order; the last one wins)."""
    one = np.flatnonzero(((lines.flags & STEP) != 0) & (slot_of >= 0))
    two = np.flatnonzero(((lines.flags & STEP2) != 0) & (last_of >= 0))
    if len(one) + len(two) == 0:
        return
    keys = np.concatenate([one * 2, two * 2 + 1])            # (line, part) in input order
    slots = np.concatenate([slot_of[one], last_of[two]])
    latest = np.full(int(slots.max()) + 1, -1, dtype=np.int64)
    np.maximum.at(latest, slots, keys)   # numpy, not numba: the merging process never loads numba (~100 MB)
    for slot in np.flatnonzero(latest >= 0).tolist():
        candidates = np.sort(keys[slots == slot])
        # the slot's first progress line of the chunk (a candidate may be no progress line: "after")
        for key in candidates.tolist():
            if _note_progress(scanner, data, first_number, lines, ends, slot, key):
                break
        if _note_progress(scanner, data, first_number, lines, ends, slot, int(latest[slot])):
            continue
        # not a progress line after all ("after", "iterate"...): the slot's earlier candidates
        for key in candidates[::-1].tolist():
            if _note_progress(scanner, data, first_number, lines, ends, slot, key):
                break


def _note_progress(scanner: LineScanner, data, first_number: int, lines: ChunkLines, ends: np.ndarray,
                   slot: int, key: int) -> bool:
    """True when the candidate is the slot's progress line, or an exact-path line came later."""
    result, source = scanner.result, scanner.source.index
    line, part = divmod(key, 2)
    number = first_number + line
    stats = result.stats.get(slot)
    if stats is not None and stats.last_step_line is not None and stats.last_step_line >= (source, number) \
            and stats.first_step_line is not None and stats.first_step_line <= (source, number):
        return True
    begin = int(lines.starts[line])
    cut = int(lines.cuts[line])
    if part == 0:
        text = data[begin + int(lines.messages[line]): begin + cut if cut else int(ends[line])]
    else:
        text = data[begin + cut: int(ends[line])]
    return note_step(result, slot, source, number, bytes(text).decode("ascii"))
