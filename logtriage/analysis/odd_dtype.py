"""Gloo's size check aborts the rank that RECEIVED more bytes than it expected: the rank with the
narrower dtype (a bfloat16 model among float32 ones), or the neighbour of a rank with a wider one (a
float64 model sends twice the bytes its float32 neighbour waits for, and that neighbour aborts while
the float64 rank only sees the connection reset). The abort's `216 vs 108` cannot tell which; the
ranks' own lines can, where they name their dtypes (`rank 2 world 4 params torch.float64`): the
one rank that names a dtype no other rank names is the one that differs; and of the aborting rank and
its ring neighbour, the one that printed a step no other rank reached skipped a collective the others
made (its next call's larger message met theirs). A rank that then asks the
host for a petabyte was sized by what it received from the rank that differs: the check is the cause."""

from __future__ import annotations

import re
from dataclasses import replace

from logtriage.analysis.frame_readings import GARBAGE_SIZE_BYTES
from logtriage.analysis.findings import Finding
from logtriage.analysis.rank_evidence import rank_the_launcher_saw_fail
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


HOST_ALLOC_RULE = "host.cpu_alloc"


def sized_by_mismatch(root: RootCause, findings: list[Finding]) -> RootCause:
    """A host allocation of a terabyte or more (`you tried to allocate 1121742378500496 bytes`) in a job
    where gloo's size check aborted a rank: the size was computed from a message the ranks' calls
    disagreed on (split counts sent as int32 and read as int64), not from memory the job needed. The
    size check, on the rank whose message differed or its receiver, is where it started."""
    f = root.finding
    if root.rule.id != HOST_ALLOC_RULE or f is None or int(f.captures.get("bytes") or 0) < GARBAGE_SIZE_BYTES:
        return root
    check = next((g for g in findings if g.rule.id == SIZE_RULE and g.is_error), None)
    if check is None:
        return root
    # gloo's abort prints no rank prefix (a C++ terminate): the launcher's first failed worker is its rank
    rank = check.rank if check.rank is not None else rank_the_launcher_saw_fail(findings)
    return RootCause(check.rule, check, rank, (rank,) if rank is not None else (),
                     min(root.confidence, 0.5), root.reasons + (
                         f"rank {root.rank} asked the host for {int(f.captures['bytes']) / (1 << 40):,.0f} TiB, a size "
                         "no job needs: it was read out of a message whose size gloo's check refused on another "
                         f"rank (line {check.line}), so the ranks' collectives did not match",))


def size_abort_sender(root: RootCause, scan: ScanResult, keys: list[StreamKey], findings: list[Finding],
                      known: set[int], last_step: dict[int, int]) -> RootCause:
    """Who sent the message gloo's size check refused: the one rank whose lines name another dtype, else
    the one rank whose send broke; where neither tells, the one of the two ranks it can be that ran a step
    ahead of all the others, else the report names the neighbour to compare."""
    read = p2p_sender_rank(odd_dtype_rank(root, scan, keys), findings)
    return sender_may_be_a_neighbour(read, findings, known, last_step) if read is root else read


_GATHERS = frozenset({"all_gather", "all_gather_into_tensor", "all_gather_object", "_all_gather_base", "gather"})
_REDUCES = frozenset({"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"})


def sender_may_be_a_neighbour(root: RootCause, findings: list[Finding], known: set[int],
                              last_step: dict[int, int]) -> RootCause:
    """Gloo's size check names only the rank that RECEIVED more bytes than it expected. That rank
    differs itself when its tensor is the smaller one; when the odd rank's tensor is the larger one,
    its neighbour aborts instead: in a ring all_gather the rank after the sender, in an all_reduce the
    rank before it (over 233 labelled CPU runs with one aborting rank, the odd rank was the aborter in
    118, the rank before it in 74, the rank after it in 41). The log cannot tell the cases apart, so
    the rank stays and the report says which two ranks to compare, unless one of the two printed a later
    step than every other rank: it skipped a collective the others made and went on to the next one (a
    gradient all_reduce), whose larger message met the others' smaller one (`ran_ahead`), or the sender is
    the one rank a step behind all the others: it made a collective they did not (`fell_behind`)."""
    f = root.finding
    if (root.rule.id != SIZE_RULE or root.rank is None or f is None or _RECEIVED_MORE not in f.text
            or len(known) < 3 or root.rank not in known):
        return root
    world = max(known) + 1
    before, after = (root.rank - 1) % world, (root.rank + 1) % world
    collectives = {w.collective for w in findings if w.rank is not None and w.collective}
    if collectives and collectives <= _GATHERS:
        senders = (before,)
        which = f"rank {before}, the rank before it in the all_gather's ring, if rank {before}'s tensor was the larger"
    elif collectives and collectives <= _REDUCES:
        senders = (after,)
        which = f"rank {after}, the rank after it in the all_reduce's ring, if rank {after}'s tensor was the larger"
    else:
        senders = (before, after)
        which = (f"rank {before} (in an all_gather) or rank {after} (in an all_reduce), the ring neighbour that "
                 "sent to it, if that rank's tensor was the larger")
    ahead = ran_ahead(last_step, known)
    if ahead is not None and ahead in (root.rank, *senders):
        return replace(root, rank=ahead, ranks=(ahead,), confidence=min(root.confidence, 0.5), reasons=(
            *root.reasons, f"gloo's check aborted rank {root.rank} on receiving more bytes than it expected; rank "
            f"{ahead} printed step {last_step[ahead]}, a step no other rank reached: it skipped a collective the others "
            "made, and its next one's larger message met their smaller one"))
    behind = fell_behind(last_step, known)
    if behind is not None and behind in senders:
        return replace(root, rank=behind, ranks=(behind,), confidence=min(root.confidence, 0.5), reasons=(
            *root.reasons, f"gloo's check aborted rank {root.rank} on receiving more bytes than it expected; rank "
            f"{behind}, the ring neighbour that sends to it, is the one rank that never printed step "
            f"{last_step[behind] + 1} the others all reached: it made a collective the others did not (an extra "
            "gradient all_reduce), and its larger message met their smaller one"))
    return replace(root, reasons=(*root.reasons, (
        f"gloo's check aborts the rank that received more bytes than it expected: rank {root.rank} itself if its "
        f"tensor was the smaller one, or {which}; the log cannot tell which, so compare the sizes and dtypes "
        "those ranks pass to this collective")))


def fell_behind(last_step: dict[int, int], known: set[int]) -> int | None:
    """The one rank whose last step is earlier than every other known rank's, all of which printed the same
    one."""
    rank = ran_ahead({r: -step for r, step in last_step.items()}, known)   # the one lowest, as ran_ahead's highest
    if rank is None or {last_step[r] for r in known if r != rank} != {last_step[rank] + 1}:
        return None
    return rank


def ran_ahead(last_step: dict[int, int], known: set[int]) -> int | None:
    """The one rank whose last step is later than every other known rank's, each of which printed one."""
    if len(known) < 3 or not known <= set(last_step):
        return None
    top = max(last_step[r] for r in known)
    leaders = [r for r in known if last_step[r] == top]
    return leaders[0] if len(leaders) == 1 else None
