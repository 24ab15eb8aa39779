"""Collective timeouts: which rank the waiting ranks were waiting for.

Timeouts are consequences; the rank they point at is the one missing from them (never joined,
was late, left), named by a debug report, running another collective, behind on steps, or the
source of the broadcast the others waited to receive."""

from __future__ import annotations

from collections import Counter

from logtriage.analysis.findings import Finding
from logtriage.analysis.lost_peers import link_failed_first, lost_a_peer, still_working, waited_elsewhere
from logtriage.analysis.rank_evidence import odd_one_out
from logtriage.analysis.roots import RankFacts, RootCause, earliest
from logtriage.catalog.rule import Category, Role
from logtriage.rank_ranges import ranges


def named_culprit(live: list[Finding]) -> int | None:
    """The rank a debug report names as the one that lagged or differed (NCCL's desync report,
    the flight recorder, monitored_barrier's coordinator). A peer's pointer at the coordinator
    ("check rank 0 logs for faulty rank") counts only when the coordinator named no one."""
    for finding in sorted(live, key=lambda f: f.role is Role.CASCADE_CANDIDATE):
        value = finding.captures.get("culprit_rank")
        if value and value.isdigit():
            return int(value)
    return None


RPC_TIMEOUT_RULE = "dist.rpc_timeout"


def missing_rank_root(timeouts: list[Finding], live: list[Finding], facts: RankFacts,
                      findings: list[Finding]) -> RootCause:
    """`live`: the errors still standing; `findings`: every finding (a flight recorder's dump notice,
    which is no error, still carries a rank's last enqueued work)."""
    first = earliest(timeouts)
    timed_out = {f.rank for f in timeouts if f.rank is not None}
    if all(f.rule.id == RPC_TIMEOUT_RULE for f in timeouts):
        # a point-to-point call: the ranks that did not time out were not in it, and the message
        # does not name the worker it called
        return RootCause(first.rule, first, None, (), 0.4, (
            "an RPC timed out on " + (f"rank(s) {', '.join(map(str, sorted(timed_out)))}" if timed_out else "a caller")
            + "; the worker it called, which did not answer, is not named in the log",))
    # a rank whose wait ended on a peer's closed connection was in the collective too, unless it
    # had stepped past the waiting ranks (it skipped their collective and failed in a later one)
    peer_closed = {f.rank for f in live if f.rank is not None and lost_a_peer(f)}
    waited_at = _waited_at_step(timed_out, facts)
    ahead = {r for r in peer_closed if waited_at is not None and facts.last_step.get(r, -1) > waited_at}
    late = _arrived_after_the_waits(timeouts, timed_out, live, facts, peer_closed - ahead - timed_out)
    in_collective = timed_out | (peer_closed - ahead - late)
    hidden = unseen_ranks(facts)
    killed_running = {r for r in hidden - in_collective if facts.exit_codes.get(r, 0) < 0}
    if len(killed_running) == 1 and facts.known - in_collective == killed_running:
        # Output filtered, but the summary shows every other rank's timeout (from its error file), and
        # this one only as stopped by the agent's signal: it never raised, it was still elsewhere.
        hidden = frozenset()
    missing = sorted(facts.known - in_collective - hidden)
    culprit = named_culprit(live)
    if culprit is not None:
        return RootCause(first.rule, first, culprit, (culprit,), 0.75,
                         (f"a debug report names rank {culprit} as the one that lagged",))
    short = _enqueued_fewer(findings)
    if short is not None:
        rank, count, others = short
        return RootCause(first.rule, first, rank, (rank,), 0.6, (
            f"rank {rank} had enqueued NCCL work up to {count}, every other rank up to {others}: it never issued "
            "the collective the others waited in",))
    waiters = sorted(timed_out)
    if missing and waiters and all(m in facts.completed for m in missing) and (
            len(waiters) < len(missing) or (len(waiters) == len(missing) and 0 in waiters)):
        # The others finished their run: the waiting side called a collective nobody else did
        # (typically a rank-0-only branch).
        return RootCause(first.rule, first, waiters[0], tuple(waiters), 0.55, (
            f"rank(s) {', '.join(map(str, waiters))} waited in a collective that the other ranks never "
            f"called: those finished normally, so the extra collective is on the waiting side",))
    source = _broadcast_source(timeouts)
    if source is not None and source not in timed_out and (not missing or source in missing):
        return RootCause(first.rule, first, source, (source,), 0.5, (
            f"the waiting rank(s) timed out in broadcast(src={source}): rank {source}, the rank that sends, "
            "never joined it",))
    if len(missing) == 1 and missing[0] in facts.completed and peer_closed - ahead:
        # The one rank missing from the collective exited 0 while the others were in it: its peers
        # lost their connection to it, the rest waited out the timeout. It left early (a shorter data
        # shard, a stop condition of its own): the closed connections, not the timeouts, say what happened.
        only = missing[0]
        closed = earliest([f for f in live if f.rank in peer_closed - ahead and lost_a_peer(f)])
        return RootCause(closed.rule, closed, only, (only,), 0.4, (
            f"rank {only} exited cleanly while the others were still in a collective with it: ranks "
            f"{ranges(sorted(peer_closed - ahead), limit=8)} lost their connection to it and the rest timed out "
            "waiting; it stopped early (a stop condition or a data shard of its own)",))
    if len(missing) == 1 and missing[0] in late:
        only = missing[0]
        return RootCause(first.rule, first, only, (only,), 0.55, (
            f"every rank but {only} timed out in a collective, and rank {only}'s only error is a peer's closed "
            "connection printed after all of those timeouts: it reached the collective after the others had given "
            "up waiting for it",))
    if len(missing) == 1:
        only = missing[0]
        went_on = (f" (it had gone on to step {facts.last_step[only]} and failed in a later collective)"
                   if only in ahead else "")
        return RootCause(first.rule, first, only, (only,), 0.65, (
            f"every rank but {only} timed out in a collective: rank {only} never joined it{went_on}",))
    if len(waiters) == 1 and len(missing) >= 2 and not peer_closed - ahead and set(missing) <= facts.speaking:
        # One rank waited alone; every other rank, each with output of its own in this log, was
        # somewhere else, all together (another collective, a group's creation, a branch this rank
        # skipped): the lone rank took the other path. One slow rank makes the opposite picture,
        # all but one waiting; and a paste of one rank's output says nothing of the others.
        lone = waiters[0]
        return RootCause(first.rule, first, lone, (lone,), 0.45, (
            f"rank {lone} is the only rank that timed out in this collective; ranks {ranges(missing, limit=8)} "
            f"were all elsewhere together, so rank {lone}'s code took a different path from theirs",))
    if waiters and len(waiters) <= len(missing) and waited_at is not None and all(
            facts.last_step.get(r, -1) > waited_at for r in missing):
        # Every rank missing from the wait had printed a later step than the waiting ranks' last (or any
        # step, where they printed none) and gone on past (to lose its connection in a later call, or to
        # be stopped by the agent): the waiting ranks were in a collective the others had already left
        # behind, their code took another path. Which of several waiters took it is not in the log (their
        # timeouts end alike): the readings after this one (a start-up line of its own) may name one.
        at = "before printing any step" if waited_at < 0 else f"after step {waited_at}"
        return RootCause(first.rule, first, waiters[0] if len(waiters) == 1 else None, tuple(waiters), 0.4, (
            f"ranks {ranges(waiters, limit=8)} timed out in a collective {at}; ranks {ranges(missing, limit=8)} "
            "had each printed a later step and gone on past it, so the code of one of the waiting ranks took a "
            "different path (another collective, another size)",))
    if missing:
        reasons = [f"ranks {ranges(missing, limit=8)} never joined the collective the others timed out in"]
        if 0 in missing:
            reasons.append("rank 0 is among them, and rank-0-only work (saving, evaluation, logging) is the "
                           "usual reason one rank is late")
        return RootCause(first.rule, first, 0 if 0 in missing else None, tuple(missing), 0.5, tuple(reasons))
    broken = link_failed_first(live, timed_out, first)
    if broken is not None:
        return RootCause(broken.rule, broken, broken.rank, (broken.rank,), 0.5, (
            f"rank {broken.rank} did not time out: its NCCL connection failed (a peer's link or process) before "
            f"any rank's timeout, and ranks {ranges(sorted(timed_out), limit=8)} then waited for it",))
    if len(timed_out) == 1:
        only = next(iter(timed_out))
        if hidden:
            return RootCause(first.rule, first, only, (only,), 0.45, (
                f"rank {only} is the only rank that timed out; ranks {ranges(sorted(hidden), limit=8)} failed "
                "without a line of their own in this log (their output was filtered or redirected), so they "
                "cannot be read as missing from the collective",))
        return RootCause(first.rule, first, only, (only,), 0.4, (
            f"rank {only} is the only rank in this log, and it timed out in a collective",))
    # the ranks whose wait ended on a closed connection were in a collective too: theirs counts
    closed_in = [f for f in live if f.rank in peer_closed - ahead - timed_out and lost_a_peer(f)]
    enough = len(timed_out) + len({f.rank for f in closed_in}) >= 3   # two ranks: `_left_the_loop`'s reading
    odd = _odd_collective(timeouts + closed_in if enough else timeouts)
    if odd is not None:
        rank, place, others = odd
        slower = _still_in_the_loop(facts, timed_out, rank, others)
        if slower is not None:
            own = next((f for f in timeouts if f.rank == slower), first)
            return RootCause(own.rule, own, slower, (slower,), 0.45, (
                f"two ranks timed out: rank {rank} in `{place}` after its last step ({facts.last_step[rank]}), rank "
                f"{slower} still in {others} at step {facts.last_step[slower]}: rank {slower} fell behind (more "
                f"work per step, an extra micro-step), and rank {rank} finished its loop and waited",))
        return RootCause(first.rule, first, rank, (rank,), 0.5, (
            f"every rank timed out, but rank {rank} waited in `{place}` and all the others in `{others}`: "
            f"its code took a different path (uneven data, a rank-specific branch)",))
    behind = _behind(facts, timed_out)
    if behind is not None:
        return RootCause(first.rule, first, behind, (behind,), 0.4, (
            f"every rank timed out; rank {behind} was behind the others (lowest last step)" if behind in facts.last_step
            else f"ranks {ranges(sorted(timed_out), limit=8)} timed out; rank {behind} never printed a step line, "
                 "which every other rank did: it was behind them all",))
    few = _few_in_another_collective(timeouts + closed_in if enough else timeouts)
    if few is not None:
        # which of the few went first is not in the log (their timeouts end alike); the readings after this
        # one (a start-up line of its own, work after the others' last step) may name one of them
        ranks, place, others = few
        return RootCause(first.rule, first, None, tuple(ranks), 0.35, (
            f"ranks {ranges(ranks, limit=8)} waited in `{place}` and all the others in `{others}`: the code of "
            "one of them took a different path (uneven data, a rank-specific branch, another tensor size), and "
            "its partners in that call waited with it",))
    lone = waited_elsewhere(live, timeouts, peer_closed - timed_out) if not missing else None
    if lone is not None:
        # every rank is accounted for, and all but one timed out; that one's wait, in another
        # collective than theirs, ended only when they gave up and closed their connections
        return RootCause(first.rule, first, lone, (lone,), 0.45, (
            f"ranks {ranges(sorted(timed_out), limit=8)} timed out in a collective; rank {lone} did not time out, "
            f"its own wait ended on their closed connections: it was not in their collective (late, or in another "
            f"one its code took)",))
    late = still_working(live, timeouts, peer_closed - timed_out, facts) if not missing else None
    if late is not None:
        return RootCause(first.rule, first, late, (late,), 0.45, (
            f"ranks {ranges(sorted(timed_out), limit=8)} timed out in a collective; rank {late} was still printing its "
            "own progress after their timeouts, then lost its peers: it came to the collective late",))
    absent = absent_node(facts)
    if absent:
        return RootCause(first.rule, first, None, tuple(sorted(timed_out)), 0.35, (
            f"every rank in this log timed out; ranks {ranges(sorted(absent), limit=8)} print nothing and the "
            "launcher's summary does not list them: their node's console is not in this paste, and the rank the "
            "others waited for is likely among them",))
    return RootCause(first.rule, first, None, tuple(sorted(timed_out)), 0.35,
                     ("every rank timed out and nothing in the log tells them apart",))


def _waited_at_step(timed_out: set[int], facts: RankFacts) -> int | None:
    """The last step the timed-out ranks printed before their wait; -1 when none of them printed a step
    while two or more other ranks did (they timed out in their first step's collective); None when the log
    says nothing of steps."""
    steps = [facts.last_step[r] for r in timed_out if r in facts.last_step]
    if steps:
        return max(steps)
    stepped = set(facts.last_step) - timed_out
    return -1 if timed_out and timed_out <= facts.speaking and len(stepped) >= 2 else None


def unseen_ranks(facts: RankFacts) -> frozenset[int]:
    """Ranks whose output the log does not hold: silent ranks, when one of them exited with an
    error code of its own (it raised, yet printed no traceback here: `--local-ranks-filter`,
    `--redirects`, output kept in per-rank files). Such a rank may have waited like the others."""
    silent = facts.known - facts.speaking
    if not facts.speaking or not any(0 < facts.exit_codes.get(r, 0) < 128 for r in silent):
        return absent_node(facts)
    return frozenset(silent)


def absent_node(facts: RankFacts) -> frozenset[int]:
    """Ranks of another node whose console is not in the paste: silent, and outside the unbroken
    run of ranks the present agent's summary lists (every speaking rank among them), which starts
    where a node's ranks start (a multiple of its size); a node's worth of them at least. An agent
    lists each of its workers; ranks it does not list ran under another agent."""
    listed = set(facts.exit_codes)
    size = len(listed)
    if size < 2 or max(listed) - min(listed) + 1 != size or min(listed) % size or not facts.speaking <= listed:
        return frozenset()
    low, high = min(listed), max(listed)
    absent = frozenset(r for r in facts.known - facts.speaking if r < low or r > high)
    return absent if len(absent) >= size else frozenset()


def _enqueued_fewer(findings: list[Finding]) -> tuple[int, int, int] | None:
    """The watchdog's (and the flight recorder's dump notice's) `last enqueued NCCL work: N` per
    rank (one process group's numbering): the one rank behind all others, which agree, never
    issued their collective."""
    counts: dict[int, int] = {}
    for f in findings:
        value = f.captures.get("last_enqueued", "")
        if f.rank is not None and value.lstrip("-").isdigit():
            counts[f.rank] = max(counts.get(f.rank, int(value)), int(value))
    if len(counts) < 3 or len(set(counts.values())) != 2:
        return None
    low = min(counts.values())
    behind = [r for r, c in counts.items() if c == low]
    return (behind[0], low, max(counts.values())) if len(behind) == 1 else None


def _odd_collective(timeouts: list[Finding]) -> tuple[int, str, str] | None:
    """All ranks timed out: the one waiting in another collective (all_reduce while the rest sit
    in barrier, or in a barrier while the rest wait in DDP's backward, whose all-reduce has no
    Python frame of its own) is the one whose code took a different path."""
    by_rank = {f.rank: f.collective or f.last_frame for f in timeouts
               if f.rank is not None and (f.collective or f.last_frame)}
    if len(by_rank) == 2:
        return _left_the_loop(timeouts)
    rank = odd_one_out(by_rank)
    if rank is None:
        return None
    place = by_rank[rank]
    return rank, place, next(name for name in by_rank.values() if name != place)


def _few_in_another_collective(waits: list[Finding]) -> tuple[list[int], str, str] | None:
    """Every rank waited, in one of two collective calls told apart by the line of the program that made them:
    two or more ranks in one, a larger group of three or more in the other (a metric all_reduce called at line
    148 against the gradient all_reduce at line 141, cpu_adhoc 576th batch): the smaller group's code took the
    different path, as `_odd_collective`'s odd rank out does alone."""
    by_rank = {f.rank: f"{f.collective} at {f.collective_site}" for f in waits
               if f.rank is not None and f.collective and f.collective_site}
    counts = Counter(by_rank.values())
    if len(counts) != 2 or len(by_rank) < len({f.rank for f in waits if f.rank is not None}):
        return None
    (common, many), (place, few) = counts.most_common()
    if few < 2 or many < 3 or few >= many:
        return None
    return sorted(r for r, value in by_rank.items() if value == place), place, common


def _left_the_loop(timeouts: list[Finding]) -> tuple[int, str, str] | None:
    """Two ranks timed out, one in DDP's backward (its all-reduce has no Python frame of its own),
    the other in a collective its own code called outside it (a barrier after the loop): that
    rank left the training loop early (fewer batches), as the odd rank out does among more."""
    explicit = {f.rank: f.collective for f in timeouts if f.rank is not None and f.collective}
    backward = {f.rank for f in timeouts if f.rank is not None and not f.collective and "backward" in f.last_frame}
    if len(explicit) != 1 or len(backward) != 1 or set(explicit) & backward:
        return None
    rank, place = next(iter(explicit.items()))
    return rank, place, "DDP's backward all-reduce"


def _still_in_the_loop(facts: RankFacts, timed_out: set[int], left: int, others: str) -> int | None:
    """Of two ranks, the one `_left_the_loop` names waited outside the loop; if the other, still in
    DDP's backward, had printed fewer steps, it was the slow one, not the first one early."""
    if len(timed_out) != 2 or others != "DDP's backward all-reduce":
        return None
    other = next(r for r in timed_out if r != left)
    steps = facts.last_step
    return other if left in steps and other in steps and steps[left] > steps[other] else None


def _broadcast_source(timeouts: list[Finding]) -> int | None:
    """Every timeout was in a broadcast from one source rank (its call's `src=` in the traceback, or
    the rank whose ncclUniqueId a rank waited for in the store): the receivers waited for that rank
    to send."""
    sources = {_peer_waited_for(f) if f.broadcast_src is None else f.broadcast_src for f in timeouts}
    return next(iter(sources)) if len(sources) == 1 else None


def _peer_waited_for(finding: Finding) -> int | None:
    peer = finding.captures.get("peer", "") if finding.rule.id == "nccl.unique_id_timeout" else ""
    return int(peer) if peer.isdigit() else None


def _behind(facts: RankFacts, ranks: set[int]) -> int | None:
    steps = {r: facts.last_step[r] for r in ranks if r in facts.last_step}
    stepless = [r for r in ranks if r not in facts.last_step and r in facts.speaking]
    if len(stepless) == 1 and steps and len(facts.last_step) >= 3 and len(facts.last_step) + 1 == len(facts.known):
        # every other rank printed its progress lines (and was read as printing them), this one spoke but
        # never reached a step: it is behind them all (an extra collective before its first step)
        return stepless[0]
    if len(steps) < 2:
        return None
    low = min(steps.values())
    lowest = [r for r, s in steps.items() if s == low]
    return lowest[0] if len(lowest) == 1 and max(steps.values()) > low else None


def _arrived_after_the_waits(timeouts: list[Finding], timed_out: set[int], live: list[Finding], facts: RankFacts,
                             closed: set[int]) -> set[int]:
    """The one rank that did not time out when every other known rank did, whose errors are all a peer's closed
    connection printed after the last timeout: the waiting ranks gave up and closed their connections, and it
    met them closed as it arrived late (a rank that crashed closes its peers' connections before any timeout)."""
    if len(closed) != 1 or facts.known - timed_out != closed:
        return set()
    rank = next(iter(closed))
    last_wait = max(f.seq for f in timeouts)
    own = [f for f in live if f.rank == rank]
    if own and all(lost_a_peer(f) and f.seq > last_wait for f in own):
        return {rank}
    return set()
