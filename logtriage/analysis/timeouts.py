"""Collective timeouts: which rank the waiting ranks were waiting for.

Timeouts are consequences; the rank they point at is the one missing from them (never joined,
was late, left), named by a debug report, running another collective, behind on steps, or the
source of the broadcast the others waited to receive. Each reading below looks at the log's
`WaitPicture` and names a rank or passes; the first that names one is the answer. The readings for
a wait every rank took part in are in `timeout_groups`."""

from __future__ import annotations

import re
from collections.abc import Callable

from logtriage.analysis.findings import Finding
from logtriage.analysis.lost_peers import lost_a_peer
from logtriage.analysis.roots import RankFacts, RootCause, earliest
from logtriage.analysis.rule_readings import SPAWN_RULES
from logtriage.analysis.timeout_groups import EVERY_RANK_WAITED
from logtriage.analysis.wait_picture import WaitPicture, picture_of
from logtriage.catalog.rule import Role
from logtriage.demux.frames import TORCH_FILE
from logtriage.rank_ranges import ranges

RPC_TIMEOUT_RULE = "dist.rpc_timeout"
# gloo's wait on a send or recv of its own that no peer matched (`Timed out waiting 12000ms for send operation to
# complete`, unbound_buffer.cc), raised in a point-to-point call or in the job's own `work.wait()` on an isend/irecv
_P2P_WAIT = re.compile(r"\bfor (send|recv) operation to complete\b")
P2P_CALLS = {"send": frozenset({"send", "isend", "batch_isend_irecv"}),
             "recv": frozenset({"recv", "irecv", "batch_isend_irecv"})}


def named_culprit(live: list[Finding]) -> int | None:
    """The rank a debug report names as the one that lagged or differed (NCCL's desync report,
    the flight recorder, monitored_barrier's coordinator). A peer's pointer at the coordinator
    ("check rank 0 logs for faulty rank") counts only when the coordinator named no one."""
    for finding in sorted(live, key=lambda f: f.role is Role.CASCADE_CANDIDATE):
        value = finding.captures.get("culprit_rank")
        if value and value.isdigit():
            return int(value)
    return None


def missing_rank_root(timeouts: list[Finding], live: list[Finding], facts: RankFacts,
                      findings: list[Finding]) -> RootCause:
    """`live`: the errors still standing; `findings`: every finding (a flight recorder's dump notice,
    which is no error, still carries a rank's last enqueued work)."""
    picture = picture_of(timeouts, live, facts, findings)
    for reading in READINGS:
        root = reading(picture)
        if root is not None:
            return root
    return RootCause(picture.first.rule, picture.first, None, tuple(picture.waiters), 0.35,
                     ("every rank timed out and nothing in the log tells them apart",))


def _rpc(p: WaitPicture) -> RootCause | None:
    if not all(f.rule.id == RPC_TIMEOUT_RULE for f in p.timeouts):
        return None
    # a point-to-point call: the ranks that did not time out were not in it, and the message
    # does not name the worker it called
    return RootCause(p.first.rule, p.first, None, (), 0.4, (
        "an RPC timed out on " + (f"rank(s) {', '.join(map(str, p.waiters))}" if p.timed_out else "a caller")
        + "; the worker it called, which did not answer, is not named in the log",))


def _debug_report(p: WaitPicture) -> RootCause | None:
    culprit = named_culprit(list(p.live))
    if culprit is None:
        return None
    return RootCause(p.first.rule, p.first, culprit, (culprit,), 0.75,
                     (f"a debug report names rank {culprit} as the one that lagged",))


# c10d's store client timing out on a key (`wait timeout after 5000ms, keys: /default_pg/0//job/ready`, or its socket's
# `timed out after 12000ms`)
STORE_WAIT_RULE = "dist.store_wait_timeout"


def _own_store_wait(p: WaitPicture) -> RootCause | None:
    """One rank timed out in the store outside any collective (the program's own `store.get`/`store.wait`, no c10d
    call in its traceback), while every other rank that waited did so in a collective, or none waited and the
    others only lost their connection when it left: it was in a handshake of its own the others never made, and
    they waited for it in their collective (a key no rank sets, or set on another path)."""
    store = [f for f in p.timeouts if f.rule.id == STORE_WAIT_RULE]
    ranks = {f.rank for f in store}
    if len(ranks) != 1 or None in ranks or any(f.collective for f in store):
        return None
    rank = next(iter(ranks))
    others = [f for f in p.timeouts if f.rank != rank]
    if others and not all(f.collective and f.rule.id != STORE_WAIT_RULE for f in others):
        return None
    if not others and not (p.peer_closed - {rank}):
        return None
    first = earliest(store)
    where = ("every other rank that timed out did so in a collective" if others
             else "the others only lost their connection when it left")
    return RootCause(first.rule, first, rank, (rank,), 0.5, (
        f"rank {rank} timed out waiting in the store outside any collective (its own store handshake) and {where}: "
        f"rank {rank} waited for a key no rank set on this path, while the others waited for it in their collective",))


def _enqueued_fewer(p: WaitPicture) -> RootCause | None:
    """The watchdog's (and the flight recorder's dump notice's) `last enqueued NCCL work: N` per
    rank (one process group's numbering): the one rank behind all others, which agree, never
    issued their collective."""
    counts: dict[int, int] = {}
    for f in p.findings:
        value = f.captures.get("last_enqueued", "")
        if f.rank is not None and value.lstrip("-").isdigit():
            counts[f.rank] = max(counts.get(f.rank, int(value)), int(value))
    if len(counts) < 3 or len(set(counts.values())) != 2:
        return None
    low, high = min(counts.values()), max(counts.values())
    behind = [r for r, c in counts.items() if c == low]
    if len(behind) != 1:
        return None
    rank = behind[0]
    return RootCause(p.first.rule, p.first, rank, (rank,), 0.6, (
        f"rank {rank} had enqueued NCCL work up to {low}, every other rank up to {high}: it never issued "
        "the collective the others waited in",))


def _unmatched_send(p: WaitPicture) -> RootCause | None:
    """One rank timed out waiting for a point-to-point send of its own to be taken (not inside a
    collective or DDP's backward, whose rings send too): no peer posted a receive that matched it.
    Its message had a tag, a destination or a size its peer's recv did not ask for, and the peer
    that expected it timed out in that recv or waited in the next collective; the others went on.
    Only where every rank has an error of its own here: a rank that stalled or died silently (a
    pipeline stage that hung) leaves its sender waiting just the same, and is the one to name."""
    if not p.facts.known or not p.facts.known <= p.timed_out | p.peer_closed:
        return None
    senders, receivers = _point_to_point(p.timeouts, "send"), _point_to_point(p.timeouts, "recv")
    if len({f.rank for f in senders}) != 1 or len({f.rank for f in receivers}) != 1 \
            or senders[0].rank == receivers[0].rank:
        return None
    sent, peer = senders[0], receivers[0].rank
    rank = sent.rank
    return RootCause(sent.rule, sent, rank, (rank, peer), 0.4, (
        f"rank {rank} timed out waiting for a point-to-point send of its own (`{sent.last_frame}`) to be received and "
        f"rank {peer} waiting in a point-to-point recv, while every other rank has an error of its own here (none "
        "stalled silently): the pair's send and recv did not match (a tag, peer or size that differs); the log does "
        "not say which side passed the wrong argument, and the sending rank is the guess",))


def _point_to_point(timeouts: tuple[Finding, ...], kind: str) -> list[Finding]:
    """The timeouts of a point-to-point send or recv: in c10d's send/recv, or in the job's own wait on the work of
    an isend/irecv (no torch frame after it), not in a collective or DDP's backward, whose rings send too."""
    return [f for f in timeouts if f.rank is not None and (m := _P2P_WAIT.search(f.text)) and m.group(1) == kind
            and (f.collective in P2P_CALLS[kind]
                 or (not f.collective and f.last_file and not TORCH_FILE.search(f.last_file)))]


def _extra_on_the_waiting_side(p: WaitPicture) -> RootCause | None:
    waiters, missing = p.waiters, p.missing
    if not (missing and waiters and all(m in p.facts.completed for m in missing) and (
            len(waiters) < len(missing) or (len(waiters) == len(missing) and 0 in waiters))):
        return None
    # The others finished their run: the waiting side called a collective nobody else did
    # (typically a rank-0-only branch).
    return RootCause(p.first.rule, p.first, waiters[0], tuple(waiters), 0.55, (
        f"rank(s) {', '.join(map(str, waiters))} waited in a collective that the other ranks never "
        f"called: those finished normally, so the extra collective is on the waiting side",))


def _broadcast_source(p: WaitPicture) -> RootCause | None:
    """Every timeout was in a broadcast from one source rank (its call's `src=` in the traceback, or
    the rank whose ncclUniqueId a rank waited for in the store): the receivers waited for that rank
    to send."""
    sources = {_peer_waited_for(f) if f.broadcast_src is None else f.broadcast_src for f in p.timeouts}
    source = next(iter(sources)) if len(sources) == 1 else None
    if source is None or source in p.timed_out or (p.missing and source not in p.missing):
        return None
    return RootCause(p.first.rule, p.first, source, (source,), 0.5, (
        f"the waiting rank(s) timed out in broadcast(src={source}): rank {source}, the rank that sends, "
        "never joined it",))


def _peer_waited_for(finding: Finding) -> int | None:
    peer = finding.captures.get("peer", "") if finding.rule.id == "nccl.unique_id_timeout" else ""
    return int(peer) if peer.isdigit() else None


def _one_missing(p: WaitPicture) -> RootCause | None:
    if len(p.missing) != 1:
        return None
    only = p.missing[0]
    closed_ranks = p.peer_closed - p.ahead
    if only in p.facts.completed and closed_ranks:
        # The one rank missing from the collective exited 0 while the others were in it: its peers
        # lost their connection to it, the rest waited out the timeout. It left early (a shorter data
        # shard, a stop condition of its own): the closed connections, not the timeouts, say what happened.
        closed = earliest([f for f in p.live if f.rank in closed_ranks and lost_a_peer(f)])
        return RootCause(closed.rule, closed, only, (only,), 0.4, (
            f"rank {only} exited cleanly while the others were still in a collective with it: ranks "
            f"{ranges(sorted(closed_ranks), limit=8)} lost their connection to it and the rest timed out "
            "waiting; it stopped early (a stop condition or a data shard of its own)",))
    if only in p.late:
        return RootCause(p.first.rule, p.first, only, (only,), 0.55, (
            f"every rank but {only} timed out in a collective, and rank {only}'s only error is a peer's closed "
            "connection printed after all of those timeouts: it reached the collective after the others had given "
            "up waiting for it",))
    went_on = (f" (it had gone on to step {p.facts.last_step[only]} and failed in a later collective)"
               if only in p.ahead else "")
    return RootCause(p.first.rule, p.first, only, (only,), 0.65, (
        f"every rank but {only} timed out in a collective: rank {only} never joined it{went_on}",))


def _lone_waiter(p: WaitPicture) -> RootCause | None:
    waiters, missing = p.waiters, p.missing
    if not (len(waiters) == 1 and len(missing) >= 2 and not p.peer_closed - p.ahead
            and set(missing) <= p.facts.speaking):
        return None
    # One rank waited alone; every other rank, each with output of its own in this log, was
    # somewhere else, all together (another collective, a group's creation, a branch this rank
    # skipped): the lone rank took the other path. One slow rank makes the opposite picture,
    # all but one waiting; and a paste of one rank's output says nothing of the others.
    lone = waiters[0]
    if any(f.rule.id in SPAWN_RULES for f in p.findings):
        # mp.spawn prints the first child's error alone and terminates the rest: the others' waits never
        # reach the log, and the one timeout may be the rank that took another path or one that waited for it
        return RootCause(p.first.rule, p.first, lone, (lone,), 0.35, (
            f"rank {lone}'s is the only timeout in the log, but mp.spawn reports the first child's error alone and "
            f"terminates the others: ranks {ranges(list(missing), limit=8)} may have waited too, so rank {lone} took "
            "a different path from theirs or waited for the one that did",))
    return RootCause(p.first.rule, p.first, lone, (lone,), 0.45, (
        f"rank {lone} is the only rank that timed out in this collective; ranks {ranges(list(missing), limit=8)} "
        f"were all elsewhere together, so rank {lone}'s code took a different path from theirs",))


def _waiters_left_behind(p: WaitPicture) -> RootCause | None:
    waiters, missing, waited_at = p.waiters, p.missing, p.waited_at
    if not (waiters and len(waiters) <= len(missing) and waited_at is not None
            and all(p.facts.last_step.get(r, -1) > waited_at for r in missing)):
        return None
    # Every rank missing from the wait had printed a later step than the waiting ranks' last (or any
    # step, where they printed none) and gone on past (to lose its connection in a later call, or to
    # be stopped by the agent): the waiting ranks were in a collective the others had already left
    # behind, their code took another path. Which of several waiters took it is not in the log (their
    # timeouts end alike): the readings after this one (a start-up line of its own) may name one.
    at = "before printing any step" if waited_at < 0 else f"after step {waited_at}"
    return RootCause(p.first.rule, p.first, waiters[0] if len(waiters) == 1 else None, tuple(waiters), 0.4, (
        f"ranks {ranges(waiters, limit=8)} timed out in a collective {at}; ranks {ranges(list(missing), limit=8)} "
        "had each printed a later step and gone on past it, so the code of one of the waiting ranks took a "
        "different path (another collective, another size)",))


def _several_missing(p: WaitPicture) -> RootCause | None:
    if not p.missing:
        return None
    reasons = [f"ranks {ranges(list(p.missing), limit=8)} never joined the collective the others timed out in"]
    if 0 in p.missing:
        reasons.append("rank 0 is among them, and rank-0-only work (saving, evaluation, logging) is the "
                       "usual reason one rank is late")
    return RootCause(p.first.rule, p.first, 0 if 0 in p.missing else None, p.missing, 0.5, tuple(reasons))


READINGS: tuple[Callable[[WaitPicture], RootCause | None], ...] = (
    _rpc, _debug_report, _own_store_wait, _enqueued_fewer, _unmatched_send, _extra_on_the_waiting_side,
    _broadcast_source, _one_missing,
    _lone_waiter, _waiters_left_behind, _several_missing) + EVERY_RANK_WAITED
