"""Ranks that did not time out in a collective but lost their peers (their wait ended on a closed
connection), or whose link broke first: which of them the ranks that timed out had waited for."""

from __future__ import annotations

from logtriage.analysis.findings import Finding
from logtriage.analysis.roots import RankFacts, earliest
from logtriage.analysis.timestamps import clearly_before
from logtriage.catalog.rule import Category, Role
from logtriage.demux.streams import StreamKind

# NCCL's own report that a connection to a peer broke (an InfiniBand completion error, a closed
# socket): not gloo's "Connection closed by peer", which a rank prints when a timed-out peer leaves
_LINK_RULES = frozenset({"nccl.remote_error"})


def link_failed_first(live: list[Finding], timed_out: set[int], first: Finding) -> Finding | None:
    """Every rank accounted for: one rank's NCCL transport failed, printed before any timeout, and
    that rank never timed out itself: its collective broke there, and the others waited for it."""
    broken = [f for f in live if f.rule.id in _LINK_RULES and f.rank is not None and f.rank not in timed_out
              and f.seq < first.seq and clearly_before(first.stamp, f.stamp) is not True]
    ranks = {f.rank for f in broken}
    return earliest(broken) if len(ranks) == 1 else None


def lost_a_peer(f: Finding) -> bool:
    """A rank's wait that ended on a peer's closed or reset connection."""
    return f.role is Role.CASCADE_CANDIDATE and f.category is Category.COLLECTIVE_ERROR


def still_working(live: list[Finding], timeouts: list[Finding], closed: set[int], facts: RankFacts) -> int | None:
    """Of the ranks that did not time out but lost their peers, the one whose own progress line comes after
    the others' first timeout and before its own lost connection: it was still at work when they gave up
    (`rank 6 step 3 teacher cache 40 shards` below five ranks' timeouts). A rank's stdout flushed at its
    exit comes after its traceback, not before it; two such ranks say nothing."""
    if len({f.rank for f in timeouts if f.rank is not None}) < 2:
        return None
    late = []
    for rank in closed:
        own = [f for f in live if f.rank == rank and lost_a_peer(f)]
        span = next((s for k, s in facts.last_progress.items() if k.kind is StreamKind.RANK and k.rank == rank), None)
        if not own or span is None:
            continue
        lost = min(own, key=lambda f: f.line)
        waits = [f.line for f in timeouts if f.source == lost.source and f.rank not in (None, rank)]
        if waits and span[0] == lost.source and min(waits) < span[2] < lost.line:
            late.append(rank)
    return late[0] if len(late) == 1 else None


def waited_elsewhere(live: list[Finding], timeouts: list[Finding], closed: set[int]) -> int | None:
    """The one rank that did not time out but lost its peers, when its traceback shows it in another
    collective than every timed-out rank's (a barrier only rank 0 entered, while the others sat in
    DDP's backward): a peer of the waiting ranks in their own collective loses them the same way, unless
    three or more of them timed out there (their timers all ran out; its own had not: it came late)."""
    waiters = {f.rank for f in timeouts if f.rank is not None}
    if len(closed) != 1 or len(waiters) < 2:
        return None
    lone = next(iter(closed))
    places = {f.collective or f.last_frame for f in timeouts if f.rank is not None}
    own = {f.collective or f.last_frame for f in live if f.rank == lone and f.role is Role.CASCADE_CANDIDATE}
    if len(waiters) >= 3 and own == places and len(places) == 1 and "" not in places:
        # (in their one named collective, under three or more waiters: their timers all ran out, and the
        # one rank whose did not had come to it later than all of them; waiters spread over several
        # collectives, or a wait with no frame, say nothing of who came late)
        return lone
    if "" in places or len(own) != 1 or "" in own or own & places:
        return None
    return lone
