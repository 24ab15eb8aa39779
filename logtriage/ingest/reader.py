"""Read a source as raw byte lines with their byte offsets, streaming (.gz detected by content)."""

from __future__ import annotations

import gzip
import io
import sys
import zlib
from contextlib import contextmanager
from typing import BinaryIO, Iterator

from logtriage.errors import InputError
from logtriage.ingest.sources import GZIP_MAGIC, Source

CHUNK = 1 << 20


@contextmanager
def open_source(source: Source) -> Iterator[BinaryIO]:
    """A binary stream of the source's bytes, decompressed when it starts with the gzip magic."""
    if source.is_stdin:
        raw: BinaryIO = sys.stdin.buffer
        close = False
    else:
        try:
            raw = open(source.path, "rb")
        except OSError as exc:
            raise InputError(f"{source.name}: cannot open ({exc.strerror or exc})") from None
        close = True
    try:
        buffered = raw if isinstance(raw, io.BufferedReader) else io.BufferedReader(raw)
        if buffered.peek(2)[:2] == GZIP_MAGIC:
            yield gzip.GzipFile(fileobj=buffered, mode="rb")
        else:
            yield buffered
    finally:
        if close:
            raw.close()


def iter_raw_lines(source: Source) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line without its trailing newline) for every physical line. A final line
    without a newline is a line; an empty file has none. Corrupt or truncated gzip data ends
    with InputError after the lines that could be read."""
    offset = 0
    with open_source(source) as stream:
        try:
            for raw in stream:
                size = len(raw)
                if raw.endswith(b"\n"):
                    raw = raw[:-1]
                yield offset, raw
                offset += size
        except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as exc:
            raise InputError(f"{source.name}: corrupt or truncated compressed data after "
                             f"{offset} bytes ({exc})") from None
