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
from logtriage.demux.wrapped import RowJoiner
from logtriage.errors import InputError
from logtriage.ingest.reader import iter_raw_lines
from logtriage.ingest.sources import Source

DIALECT_SAMPLE = 4000
MAX_FINDINGS_PER_RULE_SLOT = 50
MAX_LAUNCHER_LINES = 200_000
MAX_STEP_TEXT = 2000
MAX_WORLD_TEXT = 4000
_WORLD = re.compile(r"world[_ ]size\s*[=:]\s*(\d{1,7})|global_world_sizes=\[(\d{1,7})", re.IGNORECASE)
# the launch command (torchrun, torch.distributed.launch/run): processes per node times fixed nodes
_NPROC = re.compile(r"--nproc[_-]per[_-]node[= ](\d{1,5})\b")
_NNODES = re.compile(r"--nnodes[= ](\S+)")
# a progress line's step; not a Slurm step id (`*** STEP 422332.0 ON node01 CANCELLED`, `job step 7.0`)
# and a tqdm-style counter after a lower-case `it` (`[3] it 5/7 | loss 0.41`)
STEP = re.compile(r"\b(?:global[_ ])?(?:step|iter(?:ation)?)\b[\"']?\s*[:=#]?\s*\[?\s*(\d{1,12})\b(?!\.\d)"
                  r"|(?-i:(?<![\w])it (\d{1,12}) ?/ ?\d)", re.IGNORECASE)


def step_number(text: str) -> int | None:
    """The step a progress line reports, or None."""
    m = STEP.search(text)
    return None if m is None else int(m.group(1) or m.group(2))


def may_hold_step(text: str) -> bool:
    """The cheap test before STEP (the fast kernel's is the same: "tep", "ter" or "it ")."""
    return "tep" in text or "ter" in text or "it " in text


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
    first_step_line: tuple[int, int] | None = None   # (source, line) of its first progress line


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
    hits: list[Hit] = field(default_factory=list)
    stats: dict[int, SlotStats] = field(default_factory=dict)
    launcher_lines: list[tuple[int, int, str]] = field(default_factory=list)   # (source, line, text)
    probes: list[tuple[int, int, int, str]] = field(default_factory=list)      # (source, line, slot, text)
    banner_lines: list[str] = field(default_factory=list)
    blocks: dict[int, tuple[int, int, int]] = field(default_factory=dict)      # id -> (source, first, last)
    block_slots: dict[int, int] = field(default_factory=dict)
    block_kinds: dict[int, str] = field(default_factory=dict)
    block_exceptions: dict[int, str] = field(default_factory=dict)
    block_collectives: dict[int, str] = field(default_factory=dict)   # the c10d call a traceback was in
    block_checkpoint_frames: dict[int, str] = field(default_factory=dict)   # its checkpoint save/load frame
    block_last_frames: dict[int, str] = field(default_factory=dict)   # its innermost frame's function
    block_last_files: dict[int, str] = field(default_factory=dict)    # that frame's file
    block_broadcast_sources: dict[int, int] = field(default_factory=dict)   # a broadcast's src rank
    block_cause_frames: dict[int, str] = field(default_factory=dict)   # a chain's first exception's frame
    block_cause_files: dict[int, str] = field(default_factory=dict)    # that frame's file
    block_exception_lines: dict[int, tuple[int, int]] = field(default_factory=dict)  # -> (source, line)
    block_handling_lines: dict[int, int] = field(default_factory=dict)   # its "During handling ..." line
    indexes: list[SourceIndex] = field(default_factory=list)
    input_lines: int = 0
    fragments: int = 0
    problems: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)   # sources whose reading stopped early
    skipped_hits: int = 0
    world_size: int | None = None
    cpu_backend: bool = False        # the log names gloo or a CPU build of torch: a CPU job
    multi_node: bool = False         # lines carry node labels (pdsh hosts, srun tasks that are nodes)
    srun_tasks_are_nodes: bool = False   # srun's labels show each task runs a node's torchrun
    seq: int = 0                                           # parts seen so far (global input order)
    per_rule_slot: dict[tuple[str, int], int] = field(default_factory=dict)


def new_result(sources: tuple[Source, ...]) -> ScanResult:
    slots = SlotTable()
    for kind in StreamKind:
        slots.fixed(kind)
    return ScanResult(sources, slots, LauncherFacts())


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
        result.block_checkpoint_frames.update(tracebacks.checkpoint_frames)
        result.block_last_frames.update(tracebacks.last_frames)
        result.block_last_files.update(tracebacks.last_files)
        result.block_broadcast_sources.update(tracebacks.broadcast_sources)
        result.block_cause_frames.update(tracebacks.cause_frames)
        result.block_cause_files.update(tracebacks.cause_files)
        result.block_handling_lines.update(tracebacks.handling_lines)
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


def note_step(result: ScanResult, slot: int, source: int, number: int, text: str) -> bool:
    """Record a progress line (`step 812`, `iteration 3`) as its stream's latest."""
    step = step_number(text)
    if step is None:
        return False
    stats = result.stats.get(slot)
    if stats is None:
        stats = result.stats[slot] = SlotStats()
    note_first_step(stats, source, number)
    if stats.last_step_line is not None and stats.last_step_line > (source, number):
        return True   # an earlier candidate, read after a later line (the fast scan's first one)
    stats.last_step = step
    stats.last_step_line = (source, number)
    stats.last_step_text = text[:300]
    return True


def note_first_step(stats: SlotStats, source: int, number: int) -> None:
    if stats.first_step_line is None or stats.first_step_line > (source, number):
        stats.first_step_line = (source, number)


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
