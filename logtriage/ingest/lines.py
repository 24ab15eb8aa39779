"""Read given lines back from an input by their byte offsets (cleaned, prefixes kept)."""

from __future__ import annotations

from logtriage.demux.clean import clean, decode
from logtriage.ingest.reader import open_source
from logtriage.ingest.sources import Source

MAX_EVIDENCE_CHARS = 2000


def read_lines(source: Source, index, numbers: list[int]) -> dict[int, str]:
    """{line number: text} for the wanted 1-based line numbers; long lines are shortened."""
    wanted = sorted({n for n in numbers if 0 < n <= len(index.offsets)})
    if not wanted:
        return {}
    out: dict[int, str] = {}
    if source.is_stdin:
        stream = index.spool
        if stream is None:
            return {}
        for n in wanted:
            stream.seek(index.offsets[n - 1])
            out[n] = _text(stream.readline())
        return out
    with open_source(source) as stream:
        for n in wanted:
            stream.seek(index.offsets[n - 1])
            out[n] = _text(stream.readline())
    return out


def _text(raw: bytes) -> str:
    text = clean(decode(raw.rstrip(b"\n")))
    if len(text) > MAX_EVIDENCE_CHARS:
        text = text[:MAX_EVIDENCE_CHARS] + f" … [{len(text) - MAX_EVIDENCE_CHARS} more characters]"
    return text
