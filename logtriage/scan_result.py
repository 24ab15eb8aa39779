"""What one pass over the inputs keeps (see scan.py): the matches, each stream's counters and
progress, the blocks, the per-line indexes; and how a progress line's step is read and noted."""

from __future__ import annotations

import re
from array import array
from dataclasses import dataclass, field
from typing import Mapping

from logtriage.analysis.timestamps import Stamp
from logtriage.catalog.rule import Rule
from logtriage.demux.launcher import LauncherFacts
from logtriage.demux.streams import SlotTable, StreamKind
from logtriage.ingest.sources import Source

# a progress line's step; not a Slurm step id (`*** STEP 422332.0 ON node01 CANCELLED`, `job step 7.0`)
# and a counter after a lower-case `it`: tqdm-style (`[3] it 5/7 | loss 0.41`) or a key (`rank4/6 it=1 loss=0.85`)
STEP = re.compile(r"\b(?:global[_ ])?(?:step|iter(?:ation)?)\b[\"']?\s*[:=#]?\s*\[?\s*(\d{1,12})\b(?!\.\d)"
                  r"|(?-i:(?<![\w])it (\d{1,12}) ?/ ?\d)|(?-i:(?<![\w])it=(\d{1,12})\b(?!\.\d))", re.IGNORECASE)


def step_number(text: str) -> int | None:
    """The step a progress line reports, or None."""
    m = STEP.search(text)
    return None if m is None else int(m.group(m.lastindex))   # the one alternative's counter that matched


def may_hold_step(text: str) -> bool:
    """The cheap test before STEP (the fast kernel's is the same: "tep", "ter", "it " or "it=")."""
    return "tep" in text or "ter" in text or "it " in text or "it=" in text


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
    block_collective_sites: dict[int, str] = field(default_factory=dict)   # the frame that made that call
    block_collective_callers: dict[int, str] = field(default_factory=dict)  # that frame's function
    block_checkpoint_frames: dict[int, str] = field(default_factory=dict)   # its checkpoint save/load frame
    block_last_frames: dict[int, str] = field(default_factory=dict)   # its innermost frame's function
    block_last_files: dict[int, str] = field(default_factory=dict)    # that frame's file
    block_broadcast_sources: dict[int, int] = field(default_factory=dict)   # a broadcast's src rank
    block_cause_frames: dict[int, str] = field(default_factory=dict)   # a chain's first exception's frame
    block_cause_files: dict[int, str] = field(default_factory=dict)    # that frame's file
    block_exception_lines: dict[int, tuple[int, int]] = field(default_factory=dict)  # -> (source, line)
    block_handling_lines: dict[int, int] = field(default_factory=dict)
    block_threads: set[int] = field(default_factory=set)   # tracebacks a thread printed as it died
    block_exit_hooks: set[int] = field(default_factory=set)   # weakref.finalize's at exit (not fatal)
    # chained tracebacks whose handler failed in a call of its own (not re-raising the first exception)
    block_handler_calls_failed: set[int] = field(default_factory=set)   # its "During handling ..." line
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
