"""Gloo's size check aborts the rank that RECEIVED more bytes than it expected: the rank with the
narrower dtype (a bfloat16 model among float32 ones), or the neighbour of a rank with a wider one (a
float64 model sends twice the bytes its float32 neighbour waits for, and that neighbour aborts while
the float64 rank only sees the connection reset). The abort's `216 vs 108` cannot tell which; the
ranks' own lines can, where they name their dtypes (`rank 2 world 4 params torch.float64`): the
one rank that names a dtype no other rank names is the one that differs."""

from __future__ import annotations

import re
from dataclasses import replace

from logtriage.analysis.roots import RootCause
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
