"""A buffered log writer that knows how many lines and bytes it has produced.

Lines are collected as blocks (one join per block) and written in multi-megabyte buffers;
`next_line` gives the 1-based number the next line will have, for the expectation sidecar.
"""

from __future__ import annotations

from typing import BinaryIO, Iterable

FLUSH_CHARS = 8 << 20


class LogWriter:
    def __init__(self, stream: BinaryIO):
        self._stream = stream
        self._pending: list[str] = []
        self._pending_chars = 0
        self._flushed_bytes = 0
        self.lines = 0

    @property
    def next_line(self) -> int:
        return self.lines + 1

    @property
    def approx_bytes(self) -> int:
        """Bytes written so far, counting pending text by characters (exact for ASCII)."""
        return self._flushed_bytes + self._pending_chars

    def line(self, text: str) -> int:
        """Write one physical line (no newline inside); returns its 1-based number."""
        self._pending.append(text)
        self._pending.append("\n")
        self._pending_chars += len(text) + 1
        self.lines += 1
        if self._pending_chars >= FLUSH_CHARS:
            self.flush()
        return self.lines

    def block(self, lines: list[str]) -> None:
        """Write many physical lines at once (the fast path)."""
        if not lines:
            return
        text = "\n".join(lines)
        self._pending.append(text)
        self._pending.append("\n")
        self._pending_chars += len(text) + 1
        self.lines += len(lines)
        if self._pending_chars >= FLUSH_CHARS:
            self.flush()

    def blocks(self, groups: Iterable[list[str]]) -> None:
        for group in groups:
            self.block(group)

    def flush(self) -> None:
        if self._pending:
            data = "".join(self._pending).encode("utf-8")
            self._stream.write(data)
            self._flushed_bytes += len(data)
            self._pending = []
            self._pending_chars = 0

    def close(self) -> int:
        """Flush everything; returns the exact number of bytes written."""
        self.flush()
        self._stream.flush()
        return self._flushed_bytes
