"""Gloo's size check aborts the rank that RECEIVED more bytes than it expected: the rank with the
narrower dtype (a bfloat16 model among float32 ones), or the neighbour of a rank with a wider one (a
float64 model sends twice the bytes its float32 neighbour waits for, and that neighbour aborts while
the float64 rank only sees the connection reset). The abort's `216 vs 108` cannot tell which; the
ranks' own lines can, where they name their dtypes (`rank 2 world 4 params torch.float64`): the
one rank that names a dtype no other rank names is the one that differs."""

from __future__ import annotations

import re
from dataclasses import replace

from logtriage.analysis.findings import Finding
from logtriage.analysis.roots import RootCause
from logtriage.catalog.rule import Category
from logtriage.demux.streams import StreamKey, StreamKind
from logtriage.ingest.lines import read_lines
from logtriage.scan_result import ScanResult

SIZE_RULE = "gloo.size_mismatch"
HEAD_LINES = 400      # each input's first lines: where scripts print their set-up
MAX_SOURCES = 64      # inputs read (a folder of per-rank files: the first ones)
_DTYPE = re.compile(r"\btorch\.(float64|float32|float16|bfloat16|half|double|int64|int32|int16|int8|uint8|bool|"
                    r"complex64|complex128)\b")


def odd_dtype_rank(root: RootCause, scan: ScanResult, keys: list[StreamKey]) -> RootCause:
    if root.rule.id != SIZE_RULE:
        return root
    named: dict[int, set[str]] = {}
    for source, index in enumerate(scan.indexes[:MAX_SOURCES]):
        numbers = list(range(1, min(HEAD_LINES, len(index.slots)) + 1))
        for number, text in read_lines(scan.sources[source], index, numbers).items():
            key = keys[scan.slots.final(index.slots[number - 1])]
            if key.kind is StreamKind.RANK and key.rank >= 0 and "torch." in text:
                dtypes = set(_DTYPE.findall(text))
                if dtypes:
                    named.setdefault(key.rank, set()).update(dtypes)
    if len(named) < 3:
        return root
    odd = [rank for rank, dtypes in named.items()
           if not dtypes & set().union(*(d for r, d in named.items() if r != rank))]
    others = {frozenset(d) for r, d in named.items() if odd and r != odd[0]}
    if len(odd) != 1 or len(others) != 1 or odd[0] == root.rank:
        return root
    rank = odd[0]
    return replace(root, rank=rank, ranks=(rank,), confidence=min(root.confidence, 0.55), reasons=(
        *root.reasons, f"rank {root.rank} aborted on receiving more bytes than it expected, and rank {rank} is "
        f"the only rank whose lines name {', '.join(sorted('torch.' + d for d in named[rank]))} (every other rank "
        f"names {', '.join(sorted('torch.' + d for d in next(iter(others))))}): rank {rank}'s tensors are the "
        "wider ones, and its neighbour aborted on them"))


# a send that a peer's abort broke: the c10d call, or the program's own send helper around
# `isend(...).wait()` (whose c10d frame has returned by then)
_P2P_SENDS = frozenset({"send", "isend", "batch_isend_irecv"})
_RECEIVED_MORE = "preamble.length <= op.nbytes"


def p2p_sender_rank(root: RootCause, findings: list[Finding]) -> RootCause:
    """Gloo aborted a rank that received more bytes than it had posted for, in a point-to-point
    exchange: the one other rank whose send then broke on the lost connection sent them. Its
    message (a wider activation, a float64 tensor) is the one that differs; the receiver only
    checked it. In a collective (`all_reduce`) no rank is in a send, and nothing changes."""
    f = root.finding
    if root.rule.id != SIZE_RULE or root.rank is None or f is None or _RECEIVED_MORE not in f.text:
        return root
    senders = {w.rank for w in findings
               if w.rank is not None and w.rank != root.rank and w.is_error
               and w.category is Category.COLLECTIVE_ERROR
               and (w.collective in _P2P_SENDS or (not w.collective and "send" in w.last_frame.lower()
                                                   and "recv" not in w.last_frame.lower()))}
    if len(senders) != 1:
        return root
    rank = senders.pop()
    return replace(root, rank=rank, ranks=(rank,), confidence=min(root.confidence, 0.55), reasons=(
        *root.reasons, f"rank {root.rank} aborted on receiving more bytes than it had posted for, and rank {rank} "
        "was the one rank whose send then broke on the lost connection: rank "
        f"{rank} sent the larger message, rank {root.rank} only checked it"))
