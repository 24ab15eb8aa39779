"""Read a source as raw byte lines with their byte offsets, streaming (.gz detected by content)."""

from __future__ import annotations

import codecs
import gzip
import io
import sys
import tempfile
import zlib
from contextlib import contextmanager
from typing import BinaryIO, Iterator

from logtriage.errors import InputError
from logtriage.ingest.sources import GZIP_MAGIC, Source, utf16_codec

CHUNK = 1 << 20
MAX_LINE = 1 << 20    # bytes of one line kept for matching: an 80 MB single-line JSON costs 1 MB
TAIL = 64 << 10       # ...plus its last bytes, where a glued rank line would be


@contextmanager
def open_source(source: Source) -> Iterator[BinaryIO]:
    """A binary stream of the source's bytes, decompressed when it starts with the gzip magic,
    transcoded to UTF-8 when it is UTF-16 (then offsets count the UTF-8 bytes)."""
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
        try:
            magic = buffered.peek(2)[:2]
        except OSError as exc:  # EIO, EISDIR...: nothing can be read at all
            raise InputError(f"{source.name}: cannot read ({exc.strerror or exc})") from None
        if magic == GZIP_MAGIC:
            yield gzip.GzipFile(fileobj=buffered, mode="rb")
        elif (codec := utf16_codec(buffered.peek(4096)[:4096])) is not None:
            with _transcoded(buffered, codec) as utf8:
                yield utf8
        else:
            yield buffered
    finally:
        if close:
            raw.close()


@contextmanager
def _transcoded(stream: BinaryIO, codec: str) -> Iterator[BinaryIO]:
    """The UTF-16 stream as UTF-8, in a temporary file (seekable: evidence lines are read back by
    offset), written chunk by chunk so memory stays flat."""
    decoder = codecs.getincrementaldecoder(codec)(errors="replace")
    with tempfile.TemporaryFile() as spool:
        while block := stream.read(CHUNK):
            spool.write(decoder.decode(block).encode("utf-8"))
        spool.write(decoder.decode(b"", final=True).encode("utf-8"))
        spool.seek(0)
        yield io.BufferedReader(spool)   # type: ignore[arg-type]


def iter_raw_lines(source: Source, tee: BinaryIO | None = None) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line without its trailing newline) for every physical line. A final line
    without a newline is a line; an empty file has none. Of a line longer than MAX_LINE bytes
    only its first MAX_LINE and last TAIL bytes are kept (memory stays bounded whatever the
    line); offsets stay exact. `tee` receives every byte read, unchanged. Corrupt or truncated
    gzip data ends with InputError after the lines that could be read."""
    offset = 0
    with open_source(source) as stream:
        try:
            while raw := stream.readline(MAX_LINE):
                size = len(raw)
                if tee is not None:
                    tee.write(raw)
                if size == MAX_LINE and not raw.endswith(b"\n"):
                    tail, rest = _rest_of_line(stream, tee)
                    size += rest
                    raw = capped(raw, tail[:-1] if tail.endswith(b"\n") else tail)
                elif raw.endswith(b"\n"):
                    raw = raw[:-1]
                yield offset, raw
                offset += size
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise InputError(f"{source.name}: corrupt or truncated compressed data after "
                             f"{offset} bytes ({exc})") from None
        except OSError as exc:
            raise InputError(f"{source.name}: read error after {offset} bytes "
                             f"({exc.strerror or exc})") from None


def capped(head: bytes, tail: bytes) -> bytes:
    """What is kept of an overlong line: its first MAX_LINE bytes and, after a ` [...] ` mark,
    its last TAIL bytes (where a glued rank line would be). Every reader keeps this shape."""
    return head + b" [...] " + tail if tail else head


def _rest_of_line(stream: BinaryIO, tee: BinaryIO | None) -> tuple[bytes, int]:
    """Read the rest of an overlong line: (its last TAIL bytes, how many bytes it had)."""
    tail = b""
    size = 0
    while chunk := stream.readline(CHUNK):
        size += len(chunk)
        if tee is not None:
            tee.write(chunk)
        tail = (tail + chunk)[-TAIL:]
        if chunk.endswith(b"\n"):
            break
    return tail, size
