"""What `triage --follow` reads from: a file followed past its end (a shrink or a new inode starts it
over), standard input read as it comes, and the bytes cut into lines with exact offsets."""

from __future__ import annotations

import os
import select
import time
from typing import Iterator

from logtriage.errors import InputError
from logtriage.ingest.reader import MAX_LINE, TAIL, capped

POLL_S = 0.2          # how often a quiet input is looked at again (and Ctrl-C noticed)
READ_BYTES = 1 << 16  # bytes per read


class LineSplitter:
    """Bytes as they arrive -> (offset, line without its newline), offsets exact. A line longer
    than MAX_LINE keeps its first MAX_LINE and last TAIL bytes, as ingest.reader does."""

    def __init__(self) -> None:
        self.offset = 0
        self._kept = bytearray()
        self._tail = bytearray()
        self._size = 0

    def feed(self, chunk: bytes) -> Iterator[tuple[int, bytes]]:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            self._add(chunk[start:] if end < 0 else chunk[start:end])
            if end < 0:
                return
            yield self._emit(newline=1)
            start = end + 1

    def flush(self) -> Iterator[tuple[int, bytes]]:   # the last line, when it had no newline
        if self._size:
            yield self._emit(newline=0)

    def _add(self, piece: bytes) -> None:
        self._size += len(piece)
        room = max(MAX_LINE - len(self._kept), 0)
        self._kept += piece[:room]
        if len(piece) > room:
            self._tail += piece[room:]
            del self._tail[:-TAIL]

    def _emit(self, newline: int) -> tuple[int, bytes]:
        line = (self.offset, capped(bytes(self._kept), bytes(self._tail)))
        self.offset += self._size + newline
        self._kept.clear()
        self._tail.clear()
        self._size = 0
        return line


class Restart(Exception):
    """The followed file shrank or was replaced: start over."""


class FileInput:
    """A file read to its end, then watched for more; a shrink or a new inode raises Restart."""

    ended = False                          # a file never ends: it is followed until Ctrl-C

    def __init__(self, path: str):
        self.path = path
        self._open()

    def _open(self) -> None:
        try:
            self.stream = open(self.path, "rb")
        except OSError as exc:
            raise InputError(f"{self.path}: cannot open ({exc.strerror or exc})") from None
        self.inode = os.fstat(self.stream.fileno()).st_ino
        self.position = 0

    def read(self) -> bytes | None:
        chunk = self.stream.read(READ_BYTES)
        if chunk:
            self.position += len(chunk)
            return chunk
        try:
            now = os.stat(self.path)
        except OSError:
            return None                    # moved away for a moment (rotation): wait
        if now.st_ino != self.inode or now.st_size < self.position:
            self.stream.close()
            self._open()
            raise Restart
        return None

    def wait(self) -> None:
        time.sleep(POLL_S)

    def close(self) -> None:
        self.stream.close()


class StdinInput:
    """Standard input, read as it comes (never waiting past POLL_S, so Ctrl-C is noticed)."""

    def __init__(self, fd: int = 0):
        self.fd = fd
        self.ended = False

    def read(self) -> bytes | None:
        try:
            ready, _, _ = select.select([self.fd], [], [], POLL_S)
        except (OSError, ValueError):      # not selectable: read blocking
            ready = [self.fd]
        if not ready:
            return None
        chunk = os.read(self.fd, READ_BYTES)
        self.ended = not chunk
        return chunk or None

    def wait(self) -> None:                # read() already waited
        pass
    close = wait
