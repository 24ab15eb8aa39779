"""The line index the viewer reads from: the byte offset of every line start, per source, and
lines read back on demand with `pread` (so a 1 GB log costs its index, not its text).

A source opens with the index of its first 256 KB only, so the first screen needs no full pass;
`extend_index` indexes the rest (numpy over 16 MB chunks) and, later, whatever a growing file
appended. Lines are the scan's lines: split on `\\n` only, a final line without a newline counts.
Lines are addressed by a global id (gid): the sources' lines one after the other, in input order.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from logtriage.demux.prefixes import Dialect
from logtriage.tui.model.text import display_text, head_dialect

CHUNK = 16 << 20
HEAD_BYTES = 256 << 10
DIALECT_SAMPLE = 4000
MAX_LINE_BYTES = 64 << 10
CACHE_LINES = 4096


@dataclass
class LineSource:
    """One input as the viewer reads it."""
    name: str                 # as shown: the path as given, or "<stdin>"
    path: str                 # a plain file to read: the input itself, or a spool of stdin / a .gz
    offsets: np.ndarray       # int64 starts of the lines indexed so far
    size: int                 # bytes those lines cover
    dialect: Dialect
    fd: int


def line_starts(fd: int, size0: int, size1: int, progress: Callable[[int], None] | None = None,
                before: np.ndarray | None = None) -> np.ndarray:
    """Starts of the lines beginning in [size0, size1): offset 0, and one past every newline;
    after `before` (the starts already known), joined in one copy."""
    parts = [before] if before is not None and len(before) else []
    if size0 == 0 < size1:
        parts.append(np.zeros(1, np.int64))
    pos = max(size0 - 1, 0)
    while pos < size1:
        buf = os.pread(fd, min(CHUNK, size1 - pos), pos)
        if not buf:
            break
        starts = np.flatnonzero(np.frombuffer(buf, np.uint8) == 10).astype(np.int64) + (pos + 1)
        parts.append(starts[(starts < size1) & (starts >= size0)])
        pos += len(buf)
        if progress is not None:
            progress(pos)
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def open_head(name: str, path: str) -> LineSource:
    """The source with its first lines indexed: enough for a first screen, at once."""
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    head = os.pread(fd, HEAD_BYTES, 0)
    cut = len(head)
    if cut < size and head.rfind(b"\n") >= 0:
        cut = head.rfind(b"\n") + 1          # whole lines only, unless one line fills the head
    offsets = line_starts_in(head[:cut])
    sample = head[:cut].split(b"\n", DIALECT_SAMPLE)[:DIALECT_SAMPLE]
    return LineSource(name, path, offsets, cut, head_dialect(sample), fd)


def line_starts_in(data: bytes) -> np.ndarray:
    if not data:
        return np.empty(0, np.int64)
    starts = np.flatnonzero(np.frombuffer(data, np.uint8) == 10).astype(np.int64) + 1
    return np.concatenate((np.zeros(1, np.int64), starts[starts < len(data)]))


def extend_index(source: LineSource, progress: Callable[[int], None] | None = None) -> tuple[np.ndarray, int]:
    """(offsets, size) covering the file as it is now; a file that shrank is indexed afresh."""
    size = os.fstat(source.fd).st_size
    if size < source.size:
        return line_starts(source.fd, 0, size, progress), size
    if size == source.size:
        return source.offsets, size
    return line_starts(source.fd, source.size, size, progress, before=source.offsets), size


class LineStore:
    """Every source's lines under one numbering; reads a line when it is drawn."""

    def __init__(self, sources: list[LineSource]):
        self.sources = sources
        self._cache: OrderedDict[int, str] = OrderedDict()
        self._rebase()

    def _rebase(self) -> None:
        counts = [len(s.offsets) for s in self.sources]
        self.bases = np.concatenate((np.zeros(1, np.int64), np.cumsum(counts, dtype=np.int64)))
        self._cache.clear()

    @property
    def total(self) -> int:
        return int(self.bases[-1])

    @property
    def size(self) -> int:
        return sum(s.size for s in self.sources)

    def update(self, index: int, offsets: np.ndarray, size: int) -> None:
        """Install a new index for one source (on the thread that draws)."""
        self.sources[index] = replace(self.sources[index], offsets=offsets, size=size)
        self._rebase()

    def snapshot(self) -> "LineStore":
        """A copy for a worker thread: later updates of this store do not move its lines."""
        return LineStore([replace(s) for s in self.sources])

    def locate(self, gid: int) -> tuple[int, int]:
        index = int(np.searchsorted(self.bases, gid, side="right")) - 1
        return index, gid - int(self.bases[index])

    def gid(self, source: int, line: int) -> int:
        """The id of a 1-based line of a source."""
        return int(self.bases[source]) + line - 1

    def line_number(self, gid: int) -> int:
        return self.locate(gid)[1] + 1

    def source_of(self, gid: int) -> LineSource:
        return self.sources[self.locate(gid)[0]]

    def raw(self, gid: int) -> bytes:
        index, local = self.locate(gid)
        source = self.sources[index]
        start = int(source.offsets[local])
        end = int(source.offsets[local + 1]) if local + 1 < len(source.offsets) else source.size
        data = os.pread(source.fd, min(max(end - start, 0), MAX_LINE_BYTES), start)
        return data[:-1] if data.endswith(b"\n") else data

    def read_text(self, gid: int) -> str:
        """The display text of a line, uncached (for workers)."""
        return display_text(self.raw(gid), self.source_of(gid).dialect)

    def text(self, gid: int) -> str:
        """The display text of a line, through a small cache (for the thread that draws)."""
        text = self._cache.get(gid)
        if text is None:
            text = self.read_text(gid)
            self._cache[gid] = text
            if len(self._cache) > CACHE_LINES:
                self._cache.popitem(last=False)
        return text

    def close(self) -> None:
        for source in self.sources:
            try:
                os.close(source.fd)
            except OSError:
                pass
