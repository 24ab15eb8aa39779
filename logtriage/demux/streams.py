"""Streams and the provisional slots the demuxer assigns lines to while it reads.

A slot is resolved to a stream only at the end of the input: a bare traceback block is decided
when it ends (launcher? a logging record's continuation? a spawned process?), a worker pid
becomes a rank when the agent names it, and output segments become attempts once the number of
failed attempts is known."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class StreamKind(str, Enum):
    RANK = "rank"
    LAUNCHER = "launcher"
    BANNER = "banner"
    PROBE = "probe"
    UNATTRIBUTED = "unattributed"


@dataclass(frozen=True, order=True)
class StreamKey:
    kind: StreamKind
    rank: int = -1          # -1 when not a rank stream
    attempt: int = 0
    host: str = ""

    @property
    def rank_or_none(self) -> int | None:
        return self.rank if self.kind is StreamKind.RANK else None

    def label(self) -> str:
        if self.kind is not StreamKind.RANK:
            return self.kind.value
        text = f"rank {self.rank}"
        if self.host:
            text += f" @{self.host}"
        if self.attempt:
            text += f" (attempt {self.attempt})"
        return text


class SlotKind(str, Enum):
    FIXED = "fixed"        # launcher, banner, probe, unattributed
    RANK = "rank"          # (rank, host, segment)
    PID = "pid"            # (pid, segment): a worker pid, a rank once the agent names it
    BLOCK = "block"        # a bare multi-line block whose owner is decided when it ends
    RANK_ATTEMPT = "rank_attempt"  # (rank, host, attempt): per-rank files name their attempt
    LOCAL = "local"        # (local rank, console, segment): a node's local rank with no host label


@dataclass
class SlotTable:
    keys: list[tuple] = field(default_factory=list)
    _index: dict[tuple, int] = field(default_factory=dict)
    redirect: dict[int, int] = field(default_factory=dict)
    blocks_opened: int = 0     # block ids are unique across all sources of one run

    def next_block_id(self) -> int:
        self.blocks_opened += 1
        return self.blocks_opened

    def slot(self, key: tuple) -> int:
        index = self._index.get(key)
        if index is None:
            index = len(self.keys)
            self.keys.append(key)
            self._index[key] = index
        return index

    def fixed(self, kind: StreamKind) -> int:
        return self.slot((SlotKind.FIXED, kind))

    def rank(self, rank: int, host: str, segment: int) -> int:
        return self.slot((SlotKind.RANK, rank, host, segment))

    def pid(self, pid: int, segment: int) -> int:
        return self.slot((SlotKind.PID, pid, segment))

    def rank_attempt(self, rank: int, host: str, attempt: int) -> int:
        return self.slot((SlotKind.RANK_ATTEMPT, rank, host, attempt))

    def local(self, local: int, console: int, segment: int) -> int:
        return self.slot((SlotKind.LOCAL, local, console, segment))

    def new_block(self) -> int:
        return self.slot((SlotKind.BLOCK, len(self.keys)))

    def final(self, slot: int) -> int:
        seen = 0
        while slot in self.redirect and seen < 64:
            slot = self.redirect[slot]
            seen += 1
        return slot

    def resolve(self, pid_rank: dict[int, int], attempt_of_segment,
                host_rank: dict[tuple[str, int], int] | None = None,
                console_rank: dict[tuple[int, int], int] | None = None) -> list[StreamKey]:
        """StreamKey for every slot. `attempt_of_segment(segment) -> attempt`; `host_rank` turns a
        host's local rank into its global rank, `console_rank` a console's (-1: its lines disagree,
        the local rank stands)."""
        host_rank = host_rank or {}
        console_rank = console_rank or {}
        out: list[StreamKey] = []
        for index in range(len(self.keys)):
            key = self.keys[self.final(index)]
            kind = key[0]
            if kind is SlotKind.FIXED:
                out.append(StreamKey(key[1]))
            elif kind is SlotKind.RANK:
                rank = host_rank.get((key[2], key[1]), key[1]) if key[2] else key[1]
                out.append(StreamKey(StreamKind.RANK, rank, attempt_of_segment(key[3]), key[2]))
            elif kind is SlotKind.LOCAL:
                rank = console_rank.get((key[2], key[1]), -1)
                rank = key[1] if rank < 0 else rank
                out.append(StreamKey(StreamKind.RANK, rank, attempt_of_segment(key[3])))
            elif kind is SlotKind.RANK_ATTEMPT:
                out.append(StreamKey(StreamKind.RANK, key[1], key[3], key[2]))
            elif kind is SlotKind.PID and key[1] in pid_rank:
                out.append(StreamKey(StreamKind.RANK, pid_rank[key[1]], attempt_of_segment(key[2])))
            else:
                out.append(StreamKey(StreamKind.UNATTRIBUTED))
        return _onto_hosts(out)


def _onto_hosts(keys: list[StreamKey]) -> list[StreamKey]:
    """A rank's lines that carry no node (the launcher summary's entry about it, a line its pid
    names) join its stream on its node (`rank 2 @task0`), when every node's ranks are global: no
    rank of an attempt is on two nodes."""
    hosts: dict[tuple[int, int], set[str]] = {}
    for key in keys:
        if key.kind is StreamKind.RANK and key.host:
            hosts.setdefault((key.rank, key.attempt), set()).add(key.host)
    if not hosts or any(len(h) > 1 for h in hosts.values()):
        return keys
    return [StreamKey(StreamKind.RANK, k.rank, k.attempt, next(iter(hosts[(k.rank, k.attempt)])))
            if k.kind is StreamKind.RANK and not k.host and (k.rank, k.attempt) in hosts else k for k in keys]
