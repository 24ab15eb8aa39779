"""A source read as whole-line chunks: a regular file through a small ring of reused buffers,
stdin or a .gz through its stream (stdin spooled to a temporary file for reading back)."""

from __future__ import annotations

import os
import tempfile
import zlib
from typing import Iterator

from logtriage.errors import InputError
from logtriage.ingest.reader import open_source
from logtriage.ingest.sources import Source
from logtriage.scan_result import SourceIndex


def file_chunks(source: Source, size: int, in_flight: int) -> Iterator[tuple[int, memoryview]]:
    """(offset, whole-line chunk) of a regular file, read into a small ring of reused buffers
    (a chunk stays valid until `in_flight` more have been read)."""
    try:
        fd = os.open(source.path, os.O_RDONLY)
    except OSError as exc:
        raise InputError(f"{source.name}: cannot open ({exc.strerror or exc})") from None
    ring = [bytearray(size) for _ in range(in_flight + 1)]
    turn = offset = 0
    try:
        while True:
            buf = ring[turn % len(ring)]
            got = os.preadv(fd, [buf], offset)
            if got == 0:
                return
            size = got
            if got == len(buf):                       # not at the end: stop after the last newline
                cut = buf.rfind(b"\n", 0, got)
                while cut < 0:                        # a line longer than the buffer: a bigger one
                    bigger = bytearray(2 * len(buf))
                    bigger[:got] = buf[:got]
                    buf = ring[turn % len(ring)] = bigger
                    more = os.preadv(fd, [memoryview(buf)[got:]], offset + got)
                    got += more
                    if more == 0 or got < len(buf):
                        cut = got - 1                 # the end of the file
                        break
                    cut = buf.rfind(b"\n", 0, got)
                size = cut + 1
            yield offset, memoryview(buf)[:size]
            offset += size
            turn += 1
    finally:
        os.close(fd)


def stream_chunks(source: Source, index: SourceIndex, size: int) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of whole-line chunks of stdin or a .gz; stdin is spooled to a temp file."""
    spool = None
    if source.is_stdin:
        spool = index.spool = tempfile.TemporaryFile()
    with open_source(source) as stream:
        carry = b""
        offset = 0
        while True:
            try:
                block = stream.read(size)
            except (EOFError, OSError, ValueError, zlib.error) as exc:
                raise InputError(f"{source.name}: corrupt or truncated compressed data after "
                                 f"{offset + len(carry)} bytes ({exc})") from None
            if spool is not None and block:
                spool.write(block)
            if not block:
                if carry:
                    yield offset, carry
                return
            cut = block.rfind(b"\n")
            if cut < 0:
                carry += block
                continue
            if carry:
                data, carry = carry + block[: cut + 1], block[cut + 1:]
            elif cut == len(block) - 1:
                data, carry = block, b""
            else:
                data, carry = block[: cut + 1], block[cut + 1:]
            yield offset, data
            offset += len(data)
