"""One pass over the inputs: read → clean → demux → match, keeping only small per-line indexes
(byte offset and slot of every line) and the few lines that matter (findings, launcher lines,
probes, banner, step lines as per-stream counters).

`LineScanner.line` is the reference: the exact processing of one physical line. The fast path
(`logtriage.fastscan`) calls it for every line that is not provably plain and assigns the plain
runs in bulk with the same outcome."""

from __future__ import annotations

import itertools
import re
import shutil
import tempfile
from itertools import islice
from typing import Callable

from logtriage.analysis.timestamps import parse_stamp
from logtriage.catalog.matcher import Matcher
from logtriage.demux.assigner import Assigner
from logtriage.demux.blocks import Part
from logtriage.demux.clean import clean, decode
from logtriage.demux.prefixes import Dialect
from logtriage.demux.streams import StreamKind
from logtriage.demux.wrapped import RowJoiner
from logtriage.errors import InputError
from logtriage.ingest.reader import iter_raw_lines
from logtriage.ingest.sources import Source
from logtriage.scan_result import Hit, ScanResult, SlotStats, SourceIndex, may_hold_step, new_result, note_step

DIALECT_SAMPLE = 4000
MAX_FINDINGS_PER_RULE_SLOT = 50
MAX_LAUNCHER_LINES = 200_000
MAX_STEP_TEXT = 2000
MAX_WORLD_TEXT = 4000
_WORLD = re.compile(r"world[_ ]size\s*[=:]\s*(\d{1,7})|global_world_sizes=\[(\d{1,7})", re.IGNORECASE)
# the launch command (torchrun, torch.distributed.launch/run): processes per node times fixed nodes
_NPROC = re.compile(r"--nproc[_-]per[_-]node[= ](\d{1,5})\b")
_NNODES = re.compile(r"--nnodes[= ](\S+)")
class LineScanner:
    """The exact processing of one source's lines, one physical line at a time."""

    def __init__(self, result: ScanResult, source: Source, index: SourceIndex, matcher: Matcher, dialect: Dialect):
        self.result, self.source, self.index, self.matcher = result, source, index, matcher
        # a file named for a rank or a worker (`worker-1.log`) that holds a launcher's console is a
        # node's: its lines name their own ranks, the agent's lines none
        self.rank_hint = None if dialect.agent_console else source.rank_hint
        self.assigner = Assigner(result.slots, result.facts, dialect, self.rank_hint, source.attempt_hint)
        result.multi_node = result.multi_node or bool(dialect.hosts) or dialect.pods or dialect.srun_nodes
        result.srun_tasks_are_nodes = result.srun_tasks_are_nodes or dialect.srun_nodes
        self.launcher_slot = result.slots.fixed(StreamKind.LAUNCHER)
        self.probe_slot = result.slots.fixed(StreamKind.PROBE)
        self.banner_slot = result.slots.fixed(StreamKind.BANNER)
        self.lines = 0
        self.joiner = RowJoiner(dialect.wrap_width, dialect.labelled) if dialect.wrap_width else None

    def line(self, number: int, offset: int, raw: bytes, may_match: bool = True, index: bool = True) -> int:
        """Process one physical line; returns the slot of its first part. `may_match=False`: the
        caller proved no rule can match it; `index=False`: the caller records offset and slot.
        In a hard-wrapped paste a row is held until the rows of its line are all read (returns -1
        while held; such a log takes this path alone, which indexes every row)."""
        text = clean(decode(raw))
        if self.joiner is None:
            return self._logical((number,), (offset,), text, may_match, index)
        slot = -1
        for numbers, offsets, joined in self.joiner.push(number, offset, text):
            slot = self._logical(numbers, offsets, joined, True, index)
        return slot

    def _logical(self, numbers: tuple[int, ...], offsets: tuple[int, ...], text: str, may_match: bool,
                 index: bool) -> int:
        result = self.result
        number = numbers[0]
        parts = self.assigner.feed(text)
        self.assigner.note_line_number(number)
        if index:
            for offset in offsets:
                self.index.offsets.append(offset)
                self.index.slots.append(parts[0].slot)
        result.fragments += len(parts) - 1
        for part in parts:
            result.seq += 1
            self._note(number, part, may_match)
        stats = result.stats.get(parts[0].slot)
        if stats is None:
            stats = result.stats[parts[0].slot] = SlotStats()
        stats.lines += len(numbers)
        if stats.first_line is None:
            stats.first_line = (self.source.index, number)
        self.lines = numbers[-1]
        return parts[0].slot

    def close(self) -> None:
        if self.joiner is not None:
            for numbers, offsets, joined in self.joiner.flush():
                self._logical(numbers, offsets, joined, True, True)
        result, assigner = self.result, self.assigner
        assigner.close()
        for block_id, (kind, slot) in assigner.blocks.items():
            result.block_slots[block_id] = slot
            result.block_kinds[block_id] = kind.value
        tracebacks = assigner.tracebacks
        result.block_exceptions.update(tracebacks.exceptions)
        result.block_collectives.update(tracebacks.collectives)
        result.block_collective_sites.update(tracebacks.collective_sites)
        result.block_collective_callers.update(tracebacks.collective_callers)
        result.block_checkpoint_frames.update(tracebacks.checkpoint_frames)
        result.block_last_frames.update(tracebacks.last_frames)
        result.block_last_files.update(tracebacks.last_files)
        result.block_broadcast_sources.update(tracebacks.broadcast_sources)
        result.block_cause_frames.update(tracebacks.cause_frames)
        result.block_cause_files.update(tracebacks.cause_files)
        result.block_handling_lines.update(tracebacks.handling_lines)
        result.block_threads.update(tracebacks.threads)
        result.block_exit_hooks.update(tracebacks.exit_hooks)
        result.block_handler_calls_failed.update(tracebacks.handler_calls_failed)
        for block_id, line in tracebacks.exception_lines.items():
            result.block_exception_lines[block_id] = (self.source.index, line)
        result.input_lines += self.lines
        _note_rule_timeouts(result, self.matcher)

    def _note(self, number: int, part: Part, may_match: bool = True) -> None:
        result, text, slot = self.result, part.text, part.slot
        source = self.source.index
        if part.block_id >= 0:
            first = result.blocks.get(part.block_id)
            result.blocks[part.block_id] = (source, first[1] if first else number, number)
        if not text:
            return
        if slot == self.launcher_slot:
            if len(result.launcher_lines) < MAX_LAUNCHER_LINES:
                result.launcher_lines.append((source, number, text))
        elif slot == self.probe_slot:
            result.probes.append((source, number, slot, text))
        elif slot == self.banner_slot and len(result.banner_lines) < 200:
            result.banner_lines.append(text)
        if not result.cpu_backend and ("gloo" in text or "+cpu" in text):
            result.cpu_backend = True
        if ("orld" in text or "ORLD" in text) and len(text) < MAX_WORLD_TEXT:
            m = _WORLD.search(text)
            if m:
                value = int(m.group(1) or m.group(2))
                if 0 < value <= 1_000_000:
                    result.world_size = max(result.world_size or 0, value)
        if "nproc" in text and len(text) < MAX_WORLD_TEXT:
            _note_launch_world(result, text)
        if may_hold_step(text) and len(text) < MAX_STEP_TEXT:
            note_step(result, slot, source, number, text)
        for hit in (self.matcher.match(text) if may_match else ()):
            key = (hit.rule.id, slot)
            count = result.per_rule_slot.get(key, 0)
            result.per_rule_slot[key] = count + 1
            if count >= MAX_FINDINGS_PER_RULE_SLOT:
                result.skipped_hits += 1
                continue
            result.hits.append(Hit(hit.rule, hit.captures, source, number, slot, text, part.block_id,
                                   result.seq, parse_stamp(text)))


def _note_launch_world(result: ScanResult, text: str) -> None:
    """`torchrun --nproc_per_node=4 [--nnodes=2] ...`: the world the launch asked for (not with an
    elastic node range, `--nnodes=1:4`, whose size the log does not fix)."""
    m = _NPROC.search(text)
    if not m:
        return
    nodes = _NNODES.search(text)
    count = nodes.group(1) if nodes else "1"
    if count.isdigit() and 0 < int(m.group(1)) * int(count) <= 1_000_000:
        result.world_size = max(result.world_size or 0, int(m.group(1)) * int(count))


def _note_rule_timeouts(result: ScanResult, matcher: Matcher) -> None:
    """A user rule on the `regex` engine that ran out of time is named once in the problems."""
    for compiled in matcher.rules:
        if not compiled.timed_out:
            continue
        head = f"rule {compiled.rule.id} ({compiled.rule.path}) timed out"
        note = (f"{head} on {compiled.timed_out} line(s), counted as no match"
                + (" and then switched off" if compiled.disabled else "")
                + ": give it an RE2-compatible pattern (no look-around or backreferences)")
        result.problems[:] = [p for p in result.problems if not p.startswith(head)] + [note]


def scan(sources: tuple[Source, ...], matcher: Matcher, progress: Callable[[int], None] | None = None) -> ScanResult:
    """The straightforward path: every line through LineScanner."""
    result = new_result(sources)
    for source in sources:
        index = SourceIndex()
        result.indexes.append(index)
        lines = _until_unreadable(_lines_with_spool(source, index), result)
        head = list(islice(lines, DIALECT_SAMPLE))
        scanner = LineScanner(result, source, index, matcher, Dialect.detect(clean(decode(raw)) for _, raw in head))
        number = 0
        for offset, raw in itertools.chain(head, lines):
            number += 1
            scanner.line(number, offset, raw)
            if progress is not None and number % 65536 == 0:
                progress(offset)
        scanner.close()
    return result


def _lines_with_spool(source: Source, index: SourceIndex):
    """Raw lines; standard input is copied to a temp file on the way so it can be re-read."""
    if not source.is_stdin:
        yield from iter_raw_lines(source)
        return
    spool = tempfile.TemporaryFile()
    index.spool = spool
    yield from iter_raw_lines(source, tee=spool)


def _until_unreadable(lines, result: ScanResult):
    """The lines up to a read error (corrupt or truncated compressed data, an I/O error); the
    error becomes a problem of the report and the source counts as unreadable."""
    try:
        yield from lines
    except InputError as exc:
        result.problems.append(str(exc))
        result.unreadable.append(str(exc))


def copy_spool(index: SourceIndex, target) -> None:
    if index.spool is not None:
        index.spool.seek(0)
        shutil.copyfileobj(index.spool, target)
