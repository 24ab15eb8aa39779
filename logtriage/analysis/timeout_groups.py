"""Collective timeouts where every rank in the log is accounted for (in the wait, or lost a peer in
it): the rank the others waited for is the one whose link broke first, the one in another collective,
the one behind on steps, the one whose wait ended otherwise, or the one still at work. Readings of a
`WaitPicture`, after `timeouts`' readings of ranks missing from the wait."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from logtriage.analysis.findings import Finding
from logtriage.analysis.lost_peers import link_failed_first, still_working, waited_elsewhere
from logtriage.analysis.rank_evidence import odd_one_out
from logtriage.analysis.roots import RankFacts, RootCause
from logtriage.analysis.wait_picture import WaitPicture, absent_node
from logtriage.rank_ranges import ranges


def _link_failed(p: WaitPicture) -> RootCause | None:
    broken = link_failed_first(list(p.live), set(p.timed_out), p.first)
    if broken is None:
        return None
    return RootCause(broken.rule, broken, broken.rank, (broken.rank,), 0.5, (
        f"rank {broken.rank} did not time out: its NCCL connection failed (a peer's link or process) before "
        f"any rank's timeout, and ranks {ranges(p.waiters, limit=8)} then waited for it",))


def _only_one_waited(p: WaitPicture) -> RootCause | None:
    if len(p.timed_out) != 1:
        return None
    only = p.waiters[0]
    if p.hidden:
        return RootCause(p.first.rule, p.first, only, (only,), 0.45, (
            f"rank {only} is the only rank that timed out; ranks {ranges(sorted(p.hidden), limit=8)} failed "
            "without a line of their own in this log (their output was filtered or redirected), so they "
            "cannot be read as missing from the collective",))
    return RootCause(p.first.rule, p.first, only, (only,), 0.4, (
        f"rank {only} is the only rank in this log, and it timed out in a collective",))


def _in_another_collective(p: WaitPicture) -> RootCause | None:
    odd = _odd_collective(p.waits)
    if odd is None:
        return None
    rank, place, others = odd
    slower = _still_in_the_loop(p.facts, p.timed_out, rank, others)
    if slower is not None:
        own = next((f for f in p.timeouts if f.rank == slower), p.first)
        return RootCause(own.rule, own, slower, (slower,), 0.45, (
            f"two ranks timed out: rank {rank} in `{place}` after its last step ({p.facts.last_step[rank]}), rank "
            f"{slower} still in {others} at step {p.facts.last_step[slower]}: rank {slower} fell behind (more "
            f"work per step, an extra micro-step), and rank {rank} finished its loop and waited",))
    return RootCause(p.first.rule, p.first, rank, (rank,), 0.5, (
        f"every rank timed out, but rank {rank} waited in `{place}` and all the others in `{others}`: "
        f"its code took a different path (uneven data, a rank-specific branch)",))


def _called_from_elsewhere(p: WaitPicture) -> RootCause | None:
    """Every rank waited in the same collective, but one rank's call came from another function of the program
    (its loop's gradient all_reduce in `main`, the others' in a helper's block of calls, `plant`, at one line or
    another of it): its code skipped a call of that block, or made one more, and the counts no longer line up."""
    waits = [f for f in p.waits if f.rank is not None and f.collective and f.collective_caller]
    by_rank = {f.rank: f.collective_caller for f in waits}
    if len(by_rank) < 3 or set(by_rank) != p.facts.known or len({f.collective for f in waits}) != 1:
        return None
    rank = odd_one_out(by_rank)
    if rank is None:
        return None
    place = by_rank[rank]
    others = next(name for name in by_rank.values() if name != place)
    own = next(f for f in waits if f.rank == rank)
    return RootCause(own.rule, own, rank, (rank,), 0.45, (
        f"every rank waited in `{own.collective}`, but rank {rank}'s call came from `{place}` and all the others' "
        f"from `{others}`: its code skipped a collective of that function's, or made one more, so it waited in a "
        "later call than theirs",))


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


def _still_in_the_loop(facts: RankFacts, timed_out: frozenset[int], left: int, others: str) -> int | None:
    """Of two ranks, the one `_left_the_loop` names waited outside the loop; if the other, still in
    DDP's backward, had printed fewer steps, it was the slow one, not the first one early."""
    if len(timed_out) != 2 or others != "DDP's backward all-reduce":
        return None
    other = next(r for r in timed_out if r != left)
    steps = facts.last_step
    return other if left in steps and other in steps and steps[left] > steps[other] else None


def _behind(p: WaitPicture) -> RootCause | None:
    facts = p.facts
    behind = _lowest_step(facts, p.timed_out)
    if behind is None:
        return None
    return RootCause(p.first.rule, p.first, behind, (behind,), 0.4, (
        f"every rank timed out; rank {behind} was behind the others (lowest last step)" if behind in facts.last_step
        else f"ranks {ranges(p.waiters, limit=8)} timed out; rank {behind} never printed a step line, "
             "which every other rank did: it was behind them all",))


def _lowest_step(facts: RankFacts, ranks: frozenset[int]) -> int | None:
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


def _few_in_another_collective(p: WaitPicture) -> RootCause | None:
    """Every rank waited, in one of two collective calls told apart by the line of the program that made them:
    two or more ranks in one, a larger group of three or more in the other (a metric all_reduce called at line
    148 against the gradient all_reduce at line 141, cpu_adhoc 576th batch): the smaller group's code took the
    different path, as `_odd_collective`'s odd rank out does alone. Which of the few went first is not in the
    log (their timeouts end alike); the readings after this one (a start-up line of its own, work after the
    others' last step) may name one of them."""
    waits = p.waits
    by_rank = {f.rank: f"{f.collective} at {f.collective_site}" for f in waits
               if f.rank is not None and f.collective and f.collective_site}
    counts = Counter(by_rank.values())
    if len(counts) != 2 or len(by_rank) < len({f.rank for f in waits if f.rank is not None}):
        return None
    (common, many), (place, few) = counts.most_common()
    if few < 2 or many < 3 or few >= many:
        return None
    ranks = sorted(r for r, value in by_rank.items() if value == place)
    return RootCause(p.first.rule, p.first, None, tuple(ranks), 0.35, (
        f"ranks {ranges(ranks, limit=8)} waited in `{place}` and all the others in `{common}`: the code of "
        "one of them took a different path (uneven data, a rank-specific branch, another tensor size), and "
        "its partners in that call waited with it",))


def _waited_elsewhere(p: WaitPicture) -> RootCause | None:
    lone = waited_elsewhere(list(p.live), list(p.timeouts), set(p.peer_closed - p.timed_out))
    if lone is None:
        return None
    # every rank is accounted for, and all but one timed out; that one's wait, in another
    # collective than theirs, ended only when they gave up and closed their connections
    return RootCause(p.first.rule, p.first, lone, (lone,), 0.45, (
        f"ranks {ranges(p.waiters, limit=8)} timed out in a collective; rank {lone} did not time out, "
        f"its own wait ended on their closed connections: it was not in their collective (late, or in another "
        f"one its code took)",))


def _still_working(p: WaitPicture) -> RootCause | None:
    late = still_working(list(p.live), list(p.timeouts), set(p.peer_closed - p.timed_out), p.facts)
    if late is None:
        return None
    return RootCause(p.first.rule, p.first, late, (late,), 0.45, (
        f"ranks {ranges(p.waiters, limit=8)} timed out in a collective; rank {late} was still printing its "
        "own progress after their timeouts, then lost its peers: it came to the collective late",))


def _absent_node(p: WaitPicture) -> RootCause | None:
    absent = absent_node(p.facts)
    if not absent:
        return None
    return RootCause(p.first.rule, p.first, None, tuple(p.waiters), 0.35, (
        f"every rank in this log timed out; ranks {ranges(sorted(absent), limit=8)} print nothing and the "
        "launcher's summary does not list them: their node's console is not in this paste, and the rank the "
        "others waited for is likely among them",))


EVERY_RANK_WAITED: tuple[Callable[[WaitPicture], RootCause | None], ...] = (
    _link_failed, _only_one_waited, _in_another_collective, _called_from_elsewhere, _behind,
    _few_in_another_collective, _waited_elsewhere, _still_working, _absent_node)
