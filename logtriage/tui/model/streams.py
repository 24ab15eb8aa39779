"""A finished triage, shaped for the screen: the rank list, the stream of every line, the
findings with their role in the causal chain, and where the root cause is."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

from logtriage.demux.streams import StreamKey, StreamKind
from logtriage.tui.model.lines import LineStore

if TYPE_CHECKING:                     # the library loads in the worker, after the first screen
    from logtriage.analysis.findings import Finding
    from logtriage.api import TriageRun
    from logtriage.catalog.rule import Rule

MAX_BLOCK_LINES = 200
KEEP_STREAMS = 6
ID_BLOCK = 1 << 20
_KIND_ORDER = {StreamKind.RANK: 0, StreamKind.LAUNCHER: 1, StreamKind.BANNER: 2, StreamKind.PROBE: 3,
               StreamKind.UNATTRIBUTED: 4}


class Status(str, Enum):
    ROOT_CAUSE = "root cause"
    FAILED = "failed"
    CASCADE = "cascade"
    KILLED = "killed"
    HUNG = "hung"
    OK = "ok"
    UNKNOWN = "unknown"


class Mark(str, Enum):
    """How a finding's line is highlighted: its part in the causal chain."""
    INITIATING = "initiating"
    CASCADE = "cascade"
    TEARDOWN = "teardown"
    CONTEXT = "context"          # warnings, advice, facts: not an error of the chain


_MARK_RANK = {Mark.INITIATING: 3, Mark.CASCADE: 2, Mark.TEARDOWN: 1, Mark.CONTEXT: 0}


@dataclass(frozen=True)
class StreamRow:
    key: StreamKey
    label: str
    status: Status
    lines: int
    last_step: int | None


@dataclass(frozen=True)
class FindingRow:
    gid: int
    mark: Mark
    rule: "Rule"
    ranks: tuple[int, ...]
    text: str
    count: int
    in_chain: bool


@dataclass(frozen=True)
class Triaged:
    run: "TriageRun"
    rows: tuple[StreamRow, ...]
    stream_of_line: np.ndarray        # stream row of every line the triage read (by gid)
    marks: dict[int, Mark]            # gid -> highlight
    rules: dict[int, "Rule"]            # gid -> the rule that explains the line
    findings: tuple[FindingRow, ...]  # the chain first, then every finding once per rule and rank
    root_gid: int | None
    root_stream: int | None
    errors: np.ndarray                # sorted gids: error findings and the tracebacks they are in
    _by_stream: dict[int, np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    def stream_gids(self, stream: int) -> np.ndarray:
        """The lines of a stream, ascending (the last few streams asked for are kept)."""
        gids = self._by_stream.pop(stream, None)
        if gids is None:
            gids = np.flatnonzero(self.stream_of_line == stream).astype(np.int64)
        self._by_stream[stream] = gids
        while len(self._by_stream) > KEEP_STREAMS:
            self._by_stream.pop(next(iter(self._by_stream)))
        return gids

    def stream_at(self, gid: int) -> int | None:
        if 0 <= gid < len(self.stream_of_line):
            value = int(self.stream_of_line[gid])
            return value if value >= 0 else None
        return None


def build_triaged(run: "TriageRun", store: LineStore) -> Triaged:
    diag, scan = run.diagnosis, run.scan
    summaries = sorted(diag.streams, key=lambda s: (_KIND_ORDER[s.key.kind], s.key))
    row_of_key = {s.key: i for i, s in enumerate(summaries)}
    extra: list[StreamKey] = []
    lut = np.full(max(len(diag.keys), 1), -1, np.int32)
    for slot in range(len(diag.keys)):
        key = diag.keys[scan.slots.final(slot)]
        if key not in row_of_key:
            row_of_key[key] = len(summaries) + len(extra)
            extra.append(key)
        lut[slot] = row_of_key[key]
    stream_of_line, counts = _stream_ids(scan, store, lut, len(row_of_key))
    rows = [StreamRow(s.key, short_label(s.key), _status(s.status, s.role), int(counts[i]), s.last_step)
            for i, s in enumerate(summaries)]
    kept = [j for j in range(len(extra)) if counts[len(summaries) + j]]
    if len(kept) < len(extra):              # slots that resolved to a stream without lines: no row
        remap = np.full(len(row_of_key) + 1, -1, stream_of_line.dtype)
        remap[:len(summaries)] = np.arange(len(summaries))
        remap[np.array([len(summaries) + j for j in kept], np.int64)] = np.arange(len(summaries), len(summaries) + len(kept))
        stream_of_line = remap[stream_of_line]          # -1 stays -1 (the last entry)
        row_of_key = {k: int(remap[i]) for k, i in row_of_key.items() if remap[i] >= 0}
    rows += [StreamRow(extra[j], short_label(extra[j]), Status.UNKNOWN, int(counts[len(summaries) + j]), None)
             for j in kept]
    marks, rules = _marks(diag.findings, diag.root, store)
    root_gid, root_stream = _root(diag, store, stream_of_line, row_of_key)
    errors = _errors(diag.findings, marks, scan.blocks, store, stream_of_line)
    return Triaged(run, tuple(rows), stream_of_line, marks, rules, _finding_rows(diag, marks, store),
                   root_gid, root_stream, errors)


def _stream_ids(scan, store: LineStore, lut: np.ndarray, streams: int) -> tuple[np.ndarray, np.ndarray]:
    """The stream row of every line (from the scan's slot of every line) and each stream's line
    count, a million lines at a time so no temporary array grows with the log."""
    ids = np.full(store.total, -1, np.int16 if streams < 32000 else np.int32)
    counts = np.zeros(streams, np.int64)
    for i, index in enumerate(scan.indexes[:len(store.sources)]):
        slots = np.frombuffer(index.slots, np.int32) if len(index.slots) else np.empty(0, np.int32)
        count = min(len(slots), int(store.bases[i + 1] - store.bases[i]))
        base = int(store.bases[i])
        for start in range(0, count, ID_BLOCK):
            block = lut[slots[start:min(count, start + ID_BLOCK)]]
            ids[base + start:base + start + len(block)] = block
            counts += np.bincount(block[block >= 0], minlength=streams)
    return ids, counts


def short_label(key: StreamKey) -> str:
    """`rank 3`, `rank 3 a1` (its second attempt), `launcher`: what fits a narrow list."""
    if key.kind is not StreamKind.RANK:
        return key.kind.value
    return f"rank {key.rank}" + (f" a{key.attempt}" if key.attempt else "")


def _status(status: str, role: str) -> Status:
    if role == "root":
        return Status.ROOT_CAUSE
    if role == "cascade":
        return Status.CASCADE
    try:
        return Status(status)
    except ValueError:
        return Status.UNKNOWN


def mark_of(finding: "Finding", root_signature: str | None) -> Mark:
    if root_signature is not None and finding.signature == root_signature:
        return Mark.INITIATING
    if finding.is_teardown:
        return Mark.TEARDOWN
    if finding.is_error:
        return Mark.CASCADE
    return Mark.CONTEXT


def _marks(findings, root, store: LineStore) -> tuple[dict[int, Mark], dict[int, "Rule"]]:
    signature = root.finding.signature if root is not None and root.finding is not None else None
    marks: dict[int, Mark] = {}
    rules: dict[int, "Rule"] = {}
    for f in findings:
        gid = store.gid(f.source, f.line)
        mark = mark_of(f, signature)
        if gid not in marks or _MARK_RANK[mark] > _MARK_RANK[marks[gid]]:
            marks[gid] = mark
            rules[gid] = f.rule
    return marks, rules


def _root(diag, store: LineStore, stream_of_line: np.ndarray, row_of_key) -> tuple[int | None, int | None]:
    root = diag.root
    if root is None:
        return None, None
    if root.finding is not None:
        gid = store.gid(root.finding.source, root.finding.line)
        stream = int(stream_of_line[gid]) if gid < len(stream_of_line) else -1
        return gid, (stream if stream >= 0 else row_of_key.get(root.finding.stream))
    for s in diag.streams:                   # a hang: the stuck rank's last progress line
        if s.key.kind is StreamKind.RANK and s.key.rank in root.ranks:
            gid = store.gid(*s.last_step_line) if s.last_step_line else None
            return gid, row_of_key[s.key]
    return None, None


def _errors(findings, marks, blocks, store: LineStore, stream_of_line: np.ndarray) -> np.ndarray:
    wanted: set[int] = set()
    for f in findings:
        gid = store.gid(f.source, f.line)
        if marks.get(gid, Mark.CONTEXT) is Mark.CONTEXT:
            continue
        wanted.add(gid)
        block = blocks.get(f.block_id) if f.block_id >= 0 else None
        if block is None or block[0] != f.source or gid >= len(stream_of_line):
            continue
        first = store.gid(block[0], max(block[1], block[2] - MAX_BLOCK_LINES + 1))
        last = min(store.gid(block[0], block[2]), len(stream_of_line) - 1)
        span = np.arange(first, last + 1)
        wanted.update(int(g) for g in span[stream_of_line[first:last + 1] == stream_of_line[gid]])
    return np.array(sorted(wanted), np.int64)


def _finding_rows(diag, marks: dict[int, Mark], store: LineStore) -> tuple[FindingRow, ...]:
    rows = []
    for link in diag.chain:
        gid = store.gid(link.first.source, link.first.line)
        rows.append(FindingRow(gid, Mark(link.role.value), link.rule, link.ranks, link.first.text, link.count, True))
    grouped: dict[tuple, list] = {}
    for f in diag.findings:
        grouped.setdefault((f.rule.id, f.rank, f.stream.attempt, f.rank is None and f.stream.label()), []).append(f)
    for group in sorted(grouped.values(), key=lambda g: g[0].seq):
        f = group[0]
        gid = store.gid(f.source, f.line)
        rows.append(FindingRow(gid, marks.get(gid, Mark.CONTEXT), f.rule, (f.rank,) if f.rank is not None else (),
                               f.text, len(group), False))
    return tuple(rows)
