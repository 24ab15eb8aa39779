"""Follow a growing log or a pipe that never closes: `triage --follow FILE`, `triage --follow -`.

Every finding is printed as one line the moment its line is read:

    finding: run.log:812 rank 3 gloo.timeout: RuntimeError: ... Timed out waiting 10000ms ...

and the full report follows when standard input ends or on Ctrl-C (which is how following
ends: exit code 0, the report is the result; a second Ctrl-C exits at once with 130). A file that
shrinks or is replaced (truncated, rotated) is announced on stderr and read again from its start.

Lines go through `triage FILE`'s per-line machinery (scan.LineScanner); the prefix dialect is
chosen from the first DIALECT_SAMPLE lines, or from what arrived when the input first goes quiet."""

from __future__ import annotations

import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TextIO

from logtriage.api import TriageOptions, finish, get_catalog, get_matcher, make_redactor
from logtriage.catalog.matcher import Matcher
from logtriage.demux.clean import clean, decode
from logtriage.demux.prefixes import Dialect
from logtriage.demux.streams import SlotKind, StreamKind
from logtriage.errors import InputError, UsageError
from logtriage.ingest.sources import Source, display_name, starts_gzip, utf16_codec
from logtriage.report.model import Report
from logtriage.report.safe import terminal_safe
from logtriage.follow_inputs import FileInput, LineSplitter, Restart, StdinInput
from logtriage.scan import DIALECT_SAMPLE, LineScanner
from logtriage.scan_result import ScanResult, SourceIndex, new_result

FINDING_TEXT = 200    # characters of a finding's text


@dataclass
class Session:
    """One pass over the followed input (a restart begins a new one)."""
    source: Source
    matcher: Matcher
    result: ScanResult = field(init=False)
    index: SourceIndex = field(default_factory=SourceIndex)
    splitter: LineSplitter = field(default_factory=LineSplitter)
    scanner: LineScanner | None = None
    waiting: list[tuple[int, bytes]] = field(default_factory=list)   # lines before the dialect is known
    number: int = 0
    shown: int = 0                          # hits already printed

    def __post_init__(self) -> None:
        self.result = new_result((self.source,))
        self.result.indexes.append(self.index)
        if self.source.is_stdin:
            self.index.spool = tempfile.TemporaryFile()

    def take(self, chunk: bytes) -> None:
        if self.index.spool is not None:
            self.index.spool.write(chunk)
        for offset, raw in self.splitter.feed(chunk):
            self._line(offset, raw)

    def quiet(self) -> None:               # nothing more for now: the dialect from what arrived
        if self.scanner is None and self.waiting:
            self._start()

    def finish(self) -> ScanResult:
        for offset, raw in self.splitter.flush():
            self._line(offset, raw)
        if self.scanner is None:
            self._start()
        self.scanner.close()
        return self.result

    def _line(self, offset: int, raw: bytes) -> None:
        if self.scanner is None:
            self.waiting.append((offset, raw))
            if len(self.waiting) >= DIALECT_SAMPLE:
                self._start()
            return
        self.number += 1
        self.scanner.line(self.number, offset, raw)

    def _start(self) -> None:
        dialect = Dialect.detect(clean(decode(raw)) for _, raw in self.waiting)
        self.scanner = LineScanner(self.result, self.source, self.index, self.matcher, dialect)
        waiting, self.waiting = self.waiting, []
        for offset, raw in waiting:
            self._line(offset, raw)


def follow(target: str, options: TriageOptions, out: TextIO, err: TextIO) -> Report:
    """Follow `target` (a path or "-"), printing findings to `out`; the report when it ends."""
    catalog = get_catalog(options.patterns_dirs)
    if options.strict_catalog:
        catalog.strict()
    source = _source(target)
    reader = StdinInput() if source.is_stdin else FileInput(target)
    redactor, _ = make_redactor(options)
    shown_text = redactor.redact if redactor is not None else (lambda s: s)
    session = Session(source, get_matcher(catalog, options.patterns_dirs))
    stop = _StopOnInterrupt()
    try:
        while not stop.requested:
            try:
                chunk = reader.read()
            except Restart:
                err.write(f"triage: {terminal_safe(source.name)} shrank (truncated or replaced); "
                          "reading it again from the start\n")
                err.flush()
                session = Session(source, session.matcher)
                continue
            if chunk:
                session.take(chunk)
                _print_new_findings(session, out, shown_text)
                continue
            if reader.ended:
                break
            session.quiet()
            _print_new_findings(session, out, shown_text)
            reader.wait()
    finally:
        stop.restore()
        reader.close()
    result = session.finish()
    _print_new_findings(session, out, shown_text)
    return finish(result, catalog, options).report


def _source(target: str) -> Source:
    if target == "-":
        return Source(0, "<stdin>", None)
    path = Path(target)
    if path.is_dir():
        raise UsageError(f"{target}: --follow takes one file or '-', not a folder")
    try:
        if starts_gzip(path):
            raise UsageError(f"{target}: a compressed file cannot be followed")
        with open(path, "rb") as f:
            if utf16_codec(f.read(4096)):
                raise UsageError(f"{target}: a UTF-16 file cannot be followed (convert it: iconv -f UTF-16 -t UTF-8)")
    except OSError as exc:
        raise InputError(f"{target}: cannot read ({exc.strerror or exc})") from None
    return Source(0, display_name(target), path)


def _print_new_findings(session: Session, out: TextIO, shown_text: Callable[[str], str]) -> None:
    hits = session.result.hits
    for position in range(session.shown, len(hits)):
        hit = hits[position]
        before = hits[position - 1] if position else None
        if hit.rule.role.value == "context" or (before and (before.line, before.slot) == (hit.line, hit.slot)):
            continue   # advice lines; a second rule on the same line (the best one came first)
        text = shown_text(hit.text)
        text = text if len(text) <= FINDING_TEXT else text[:FINDING_TEXT - 1] + "…"
        who = _who(session.result, hit.slot, hit.captures)
        out.write(terminal_safe(f"finding: {session.source.name}:{hit.line} {who} {hit.rule.id}: {text}") + "\n")
    if session.shown != len(hits):
        out.flush()
    session.shown = len(hits)


def _who(result: ScanResult, slot: int, captures) -> str:
    """The rank as far as it is known while reading (the report settles late-bound owners)."""
    if str(captures.get("rank", "")).isdigit() and len(captures["rank"]) <= 12:
        return f"rank {captures['rank']}"
    key = result.slots.keys[result.slots.final(slot)]
    if key[0] in (SlotKind.RANK, SlotKind.RANK_ATTEMPT):
        return f"rank {key[1]}"
    if key[0] is SlotKind.LOCAL:
        rank = result.facts.console_rank.get((key[2], key[1]), -1)
        return f"rank {rank}" if rank >= 0 else f"local rank {key[1]}"
    if key[0] is SlotKind.PID:
        rank = result.facts.pid_to_rank().get(key[1])
        return f"rank {rank}" if rank is not None else f"pid {key[1]}"
    if key[0] is SlotKind.FIXED and key[1] is not StreamKind.UNATTRIBUTED:
        return key[1].value
    return "rank ?"


class _StopOnInterrupt:
    """The first Ctrl-C asks the loop to stop (the report is printed); a second one interrupts."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def restore(self) -> None:
        signal.signal(signal.SIGINT, self._previous)
