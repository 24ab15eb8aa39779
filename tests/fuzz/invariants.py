"""What must hold for any input, checked after a triage: shared by the property tests and the
atheris harness."""

from __future__ import annotations

import gzip
import io
import re
import zlib
from pathlib import Path

import orjson

from logtriage.api import TriageOptions, TriageRun, run_triage
from logtriage.report import render
from logtriage.ingest.sources import GZIP_MAGIC, utf16_codec
from tests.fuzz.strategies import physical_lines

# What a terminal would obey: C0 controls except \t and \n, DEL, C1 controls (0x9b is CSI), bidi overrides.
TERMINAL_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
# The same on raw output bytes: ESC, BEL..., C1 controls as UTF-8 (C2 80-9F), bidi overrides.
RAW_TERMINAL_UNSAFE = re.compile(rb"[\x00-\x08\x0b-\x1f\x7f]|\xc2[\x80-\x9f]|\xe2\x80[\xaa-\xae]|\xe2\x81[\xa6-\xa9]")
# Markdown outside fenced code: a raw tag opener would be HTML.
_FENCED = re.compile(r"^(`{3,})text\n.*?\n\1$", re.MULTILINE | re.DOTALL)
_RAW_TAG = re.compile(r"<[A-Za-z/!?]")


def check_conservation(run: TriageRun, files: list[Path]) -> None:
    """Every physical line of every file is in exactly one stream, at its own line number."""
    scan = run.scan
    total = 0
    for index, path in zip(scan.indexes, files):
        data = path.read_bytes()
        damaged = False
        if data[:2] == GZIP_MAGIC:
            data, damaged = _gunzip_prefix(data)
        elif (codec := utf16_codec(data[:4096])) is not None:   # read as its UTF-8 text
            data = data.decode(codec, errors="replace").encode("utf-8")
        lines = physical_lines(data)
        if damaged:  # complete lines before the damage; the cut line may be lost
            assert len(lines) - 1 <= len(index.slots) <= len(lines), (path, len(index.slots), len(lines))
            lines = lines[: len(index.slots)]
        assert len(index.slots) == len(lines), (path, len(index.slots), len(lines))
        assert len(index.offsets) == len(lines)
        offset = 0
        for number, raw in enumerate(lines, 1):
            assert index.offsets[number - 1] == offset, (path, number)
            offset += len(raw) + 1
        total += len(lines)
    assert scan.input_lines == total
    report = run.report.to_dict()
    assert report["input_lines"] == scan.input_lines
    assert sum(s["lines"] for s in report["streams"]) == scan.input_lines
    assert all(s["lines"] > 0 for s in report["streams"])


def _gunzip_prefix(data: bytes) -> tuple[bytes, bool]:
    """The bytes a gzip stream yields before any damage, and whether there was damage."""
    out = bytearray()
    with gzip.GzipFile(fileobj=io.BytesIO(data)) as stream:
        try:
            while chunk := stream.read(1):
                out += chunk
        except (EOFError, OSError, zlib.error):
            return bytes(out), True
    return bytes(out), False


def check_outputs(run: TriageRun) -> dict:
    """All three renderings work; JSON round-trips; text and Markdown carry no control characters."""
    report = run.report
    as_json = render(report, "json")
    parsed = orjson.loads(as_json)
    assert parsed == orjson.loads(orjson.dumps(report.to_dict(), option=orjson.OPT_NON_STR_KEYS))
    for fmt in ("text", "md"):
        out = render(report, fmt, color=False)
        bad = TERMINAL_UNSAFE.search(out)
        assert bad is None, (fmt, repr(out[max(0, bad.start() - 40): bad.end() + 40]))
        out.encode("utf-8")  # no lone surrogates
    prose = _FENCED.sub("", render(report, "md"))
    tag = _RAW_TAG.search(prose)
    assert tag is None, repr(prose[max(0, tag.start() - 40): tag.end() + 40])
    return parsed


def triage_bytes(data: bytes, directory: Path, name: str = "fuzz.log",
                 options: TriageOptions = TriageOptions()) -> TriageRun:
    path = directory / name
    path.write_bytes(data)
    run = run_triage([str(path)], options)
    check_conservation(run, [path])
    check_outputs(run)
    return run
