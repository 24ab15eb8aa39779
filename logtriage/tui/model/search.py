"""Search and filter: which lines of a view match a pattern, as the lines are shown (prefixes
stripped, controls made visible).

A pattern is a regular expression in RE2 syntax (linear time: no pattern can stall the viewer),
case-insensitive unless it holds an upper-case letter; one that does not compile is taken
literally. A small view is matched line by line; a large one (the whole log) by scanning its
files in 16 MB blocks of raw bytes, then checking the candidate lines on their display text
(up to VERIFY_LIMIT candidates; beyond that the raw match counts).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
import re2

from logtriage.tui.model.lines import CHUNK, LineStore
from logtriage.tui.model.views import View

DIRECT_LIMIT = 50_000
VERIFY_LIMIT = 200_000
CACHED_QUERIES = 4
FEW_MATCHES = 20_000
_META = frozenset(".^$*+?{}[]\\|()")


@dataclass(frozen=True)
class Query:
    text: str
    literal: bool
    case_sensitive: bool
    line: object            # compiled for str: checks and highlights display text
    raw: object             # compiled for bytes: finds candidate lines in the files
    needle: bytes = b""     # an ASCII literal: found by array comparison instead of `raw`

    @classmethod
    def parse(cls, text: str) -> "Query":
        case_sensitive = any(c.isupper() for c in text)
        literal = not (set(text) & _META)
        needle = text.encode() if literal and text.isascii() else b""
        if literal and case_sensitive:
            # Python's literal search is the fastest over many matches; a literal cannot backtrack.
            return cls(text, True, True, re.compile(re.escape(text)), re.compile(re.escape(text).encode()), needle)
        if needle:
            return cls(text, True, False, re.compile(re.escape(text), re.IGNORECASE), None, needle)
        try:
            return cls(text, literal, case_sensitive, _re2(text, case_sensitive, False),
                       _re2(text.encode(), case_sensitive, False))
        except re2.error:
            return cls(text, True, case_sensitive, _re2(text, case_sensitive, True),
                       _re2(text.encode(), case_sensitive, True))

    def matches(self, line: str) -> bool:
        return self.line.search(line) is not None

    def spans(self, line: str) -> list[tuple[int, int]]:
        return [(m.start(), m.end()) for m in self.line.finditer(line) if m.end() > m.start()]


def _re2(pattern, case_sensitive: bool, literal: bool):
    options = re2.Options()
    options.log_errors = False          # RE2 would print to the terminal the app draws on
    options.case_sensitive = case_sensitive
    options.never_nl = True
    options.literal = literal
    return re2.compile(pattern, options)


def matching_gids(store: LineStore, view: View, query: Query, progress: Callable[[int, int], None] | None = None,
                  cancelled: Callable[[], bool] = lambda: False, cache: dict | None = None) -> np.ndarray | None:
    """Ascending gids of the view's lines that match; None when cancelled. `cache` keeps the raw
    candidates of the whole store per query, so changing the view does not rescan the files."""
    if view.count <= DIRECT_LIMIT:
        gids = view.all_gids()
        hits = [g for g in gids.tolist() if query.matches(store.read_text(g))]
        return np.array(sorted(hits), np.int64)
    key = (query.text, store.total, store.size)
    candidates = cache.get(key) if cache is not None else None
    if candidates is None:
        candidates = _raw_candidates(store, query, progress, cancelled)
        if candidates is None:
            return None
        if cache is not None:
            while len(cache) >= CACHED_QUERIES:
                cache.pop(next(iter(cache)))
            cache[key] = candidates
    if view.gids is not None:
        candidates = candidates[np.isin(candidates, view.gids)]
    else:
        candidates = candidates[candidates < view.count]
    if len(candidates) > VERIFY_LIMIT:
        return candidates
    checked = [g for g in candidates.tolist() if query.matches(store.read_text(g))]
    return np.array(checked, np.int64)


def _literal_starts(buf: bytes, query: Query) -> np.ndarray:
    """Where an ASCII literal starts in a block. Few matches: `bytes.find`; many (`step` is on 8
    million lines of a 1 GB log): whole-array comparisons, with no cost per match."""
    hay = buf if query.case_sensitive else buf.lower()
    needle = query.needle if query.case_sensitive else query.needle.lower()
    if hay.count(needle) <= FEW_MATCHES:
        found, at = [], hay.find(needle)
        while at >= 0:
            found.append(at)
            at = hay.find(needle, at + 1)
        return np.array(found, np.int64)
    data = np.frombuffer(hay, np.uint8)
    span = len(data) - len(needle) + 1
    hits = data[:span] == needle[0]
    for j in range(1, len(needle)):
        hits &= data[j:j + span] == needle[j]
    return np.flatnonzero(hits).astype(np.int64)


def _raw_candidates(store: LineStore, query: Query, progress, cancelled) -> np.ndarray | None:
    found: list[np.ndarray] = []
    total = max(store.size, 1)
    done = 0
    for index, source in enumerate(store.sources):
        pos = 0
        while pos < source.size:
            if cancelled():
                return None
            buf = os.pread(source.fd, min(CHUNK, source.size - pos), pos)
            if not buf:
                break
            cut = len(buf)
            if pos + cut < source.size and buf.rfind(b"\n") >= 0:
                cut = buf.rfind(b"\n") + 1     # whole lines, so no match is cut in two
                buf = buf[:cut]
            starts = _literal_starts(buf, query) if query.needle else \
                np.asarray([m.start() for m in query.raw.finditer(buf)], np.int64)
            if len(starts):
                local = np.searchsorted(source.offsets, starts + pos, side="right") - 1
                found.append(_distinct(local) + store.bases[index])
            pos += cut
            done += cut
            if progress is not None:
                progress(done, total)
    return _distinct(np.concatenate(found).astype(np.int64)) if found else np.empty(0, np.int64)


def _distinct(ascending: np.ndarray) -> np.ndarray:
    """np.unique for an array already in order, in one linear pass (np.unique sorts or hashes)."""
    if len(ascending) < 2:
        return ascending
    keep = np.empty(len(ascending), bool)
    keep[0] = True
    np.not_equal(ascending[1:], ascending[:-1], out=keep[1:])
    return ascending[keep]
