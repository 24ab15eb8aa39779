"""One pass over the inputs: read → clean → demux → match, keeping only small per-line indexes
(byte offset and slot of every line) and the few lines that matter (findings, launcher lines,
probes, banner, step lines as per-stream counters)."""

from __future__ import annotations

import re
import shutil
import tempfile
from array import array
from dataclasses import dataclass, field
from itertools import islice
from typing import Callable, Mapping

from logtriage.analysis.timestamps import Stamp, parse_stamp
from logtriage.catalog.matcher import Matcher
from logtriage.catalog.rule import Rule
from logtriage.demux.assigner import Assigner, Part
from logtriage.demux.clean import clean, decode
from logtriage.demux.launcher import LauncherFacts
from logtriage.demux.prefixes import Dialect
from logtriage.demux.streams import SlotTable, StreamKind
from logtriage.errors import InputError
from logtriage.ingest.reader import iter_raw_lines
from logtriage.ingest.sources import Source

DIALECT_SAMPLE = 4000
MAX_FINDINGS_PER_RULE_SLOT = 50
MAX_LAUNCHER_LINES = 200_000
_WORLD = re.compile(r"world[_ ]size\s*[=:]\s*(\d{1,7})|global_world_sizes=\[(\d{1,7})", re.IGNORECASE)
_STEP = re.compile(r"\b(?:global[_ ])?(?:step|iter(?:ation)?)\b\s*[:=#]?\s*\[?\s*(\d{1,12})\b", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Hit:
    """A rule matched a line."""
    rule: Rule
    captures: Mapping[str, str]
    source: int
    line: int            # 1-based within its source
    slot: int
    text: str            # message, prefixes stripped
    block_id: int
    seq: int             # global input order
    stamp: Stamp | None


@dataclass
class SlotStats:
    lines: int = 0                   # physical lines whose first part belongs here
    first_line: tuple[int, int] | None = None   # (source, line)
    last_step: int | None = None
    last_step_line: tuple[int, int] | None = None
    last_step_text: str = ""
    last_stamp: Stamp | None = None
    nan_loss_line: tuple[int, int] | None = None


@dataclass
class SourceIndex:
    """Per-line index of one source: byte offsets and first-part slots."""
    offsets: array = field(default_factory=lambda: array("q"))
    slots: array = field(default_factory=lambda: array("i"))
    spool: object | None = None      # a temp file holding stdin's bytes, for re-reading


@dataclass
class ScanResult:
    sources: tuple[Source, ...]
    slots: SlotTable
    facts: LauncherFacts
    hits: list[Hit]
    stats: dict[int, SlotStats]
    launcher_lines: list[tuple[int, int, str]]     # (source, line, text)
    probes: list[tuple[int, int, int, str]]        # (source, line, slot, text)
    banner_lines: list[str]
    blocks: dict[int, tuple[int, int, int]]        # block id -> (source, first line, last line)
    block_slots: dict[int, int]
    block_kinds: dict[int, str]
    block_exceptions: dict[int, str]
    indexes: list[SourceIndex]
    input_lines: int = 0
    fragments: int = 0
    problems: list[str] = field(default_factory=list)
    skipped_hits: int = 0
    world_size: int | None = None


def scan(sources: tuple[Source, ...], matcher: Matcher, progress: Callable[[int], None] | None = None) -> ScanResult:
    slots = SlotTable()
    facts = LauncherFacts()
    for kind in StreamKind:
        slots.fixed(kind)
    result = ScanResult(sources, slots, facts, [], {}, [], [], [], {}, {}, {}, {}, [])
    seq = 0
    per_rule_slot: dict[tuple[str, int], int] = {}
    for source in sources:
        index = SourceIndex()
        result.indexes.append(index)
        lines = _lines_with_spool(source, index)
        head = list(islice(lines, DIALECT_SAMPLE))
        dialect = Dialect.detect(clean(decode(raw)) for _, raw in head)
        assigner = Assigner(slots, facts, dialect, source.rank_hint, source.attempt_hint)
        number = 0
        try:
            for offset, raw in _chain(head, lines):
                number += 1
                text = clean(decode(raw))
                parts = assigner.feed(text)
                index.offsets.append(offset)
                index.slots.append(parts[0].slot)
                result.fragments += len(parts) - 1
                for part in parts:
                    seq += 1
                    _note(result, source.index, number, part, matcher, seq, per_rule_slot)
                stats = result.stats.setdefault(parts[0].slot, SlotStats())
                stats.lines += 1
                if stats.first_line is None:
                    stats.first_line = (source.index, number)
                if progress is not None and number % 65536 == 0:
                    progress(offset)
        except InputError as exc:
            result.problems.append(str(exc))
        assigner.close()
        for block_id, (kind, slot) in assigner.blocks.items():
            result.block_slots[block_id] = slot
            result.block_kinds[block_id] = kind.value
        result.block_exceptions.update(assigner.exceptions)
        result.input_lines += number
    return result


def _note(result: ScanResult, source: int, number: int, part: Part, matcher: Matcher, seq: int,
          per_rule_slot: dict) -> None:
    text = part.text
    slot = part.slot
    if part.block_id >= 0:
        first = result.blocks.get(part.block_id)
        result.blocks[part.block_id] = (source, first[1] if first else number, number)
    if not text:
        return
    launcher_slot = result.slots.fixed(StreamKind.LAUNCHER)
    if slot == launcher_slot and len(result.launcher_lines) < MAX_LAUNCHER_LINES:
        result.launcher_lines.append((source, number, text))
    elif slot == result.slots.fixed(StreamKind.PROBE):
        result.probes.append((source, number, slot, text))
    elif slot == result.slots.fixed(StreamKind.BANNER) and len(result.banner_lines) < 200:
        result.banner_lines.append(text)
    if ("orld" in text or "ORLD" in text) and len(text) < 4000:
        m = _WORLD.search(text)
        if m:
            value = int(m.group(1) or m.group(2))
            if 0 < value <= 1_000_000:
                result.world_size = max(result.world_size or 0, value)
    if ("tep" in text or "ter" in text) and len(text) < 2000:
        m = _STEP.search(text)
        if m:
            stats = result.stats.setdefault(slot, SlotStats())
            stats.last_step = int(m.group(1))
            stats.last_step_line = (source, number)
            stats.last_step_text = text[:300]
            stamp = parse_stamp(text)
            if stamp is not None:
                stats.last_stamp = stamp
    for hit in matcher.match(text):
        key = (hit.rule.id, slot)
        count = per_rule_slot.get(key, 0)
        per_rule_slot[key] = count + 1
        if count >= MAX_FINDINGS_PER_RULE_SLOT:
            result.skipped_hits += 1
            continue
        result.hits.append(Hit(hit.rule, hit.captures, source, number, slot, text, part.block_id, seq,
                               parse_stamp(text)))


def _lines_with_spool(source: Source, index: SourceIndex):
    """Raw lines; standard input is copied to a temp file on the way so it can be re-read."""
    if not source.is_stdin:
        yield from iter_raw_lines(source)
        return
    spool = tempfile.TemporaryFile()
    index.spool = spool
    for offset, raw in iter_raw_lines(source):
        spool.write(raw)
        spool.write(b"\n")
        yield offset, raw


def _chain(head, rest):
    yield from head
    yield from rest


def copy_spool(index: SourceIndex, target) -> None:
    if index.spool is not None:
        index.spool.seek(0)
        shutil.copyfileobj(index.spool, target)
