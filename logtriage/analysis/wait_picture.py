"""What a log says about a collective the ranks timed out in: who waited, who lost a peer instead, who
had gone on past it, who arrived after the others gave up, whose output is not in the log, and so
which ranks were missing from it. Built once; the readings in `timeouts` look at it in turn."""

from __future__ import annotations

from dataclasses import dataclass

from logtriage.analysis.findings import Finding
from logtriage.analysis.lost_peers import lost_a_peer
from logtriage.analysis.roots import RankFacts, earliest


@dataclass(frozen=True)
class WaitPicture:
    timeouts: tuple[Finding, ...]
    live: tuple[Finding, ...]        # the errors still standing
    findings: tuple[Finding, ...]    # every finding (a flight recorder's dump notice still carries a rank's work)
    facts: RankFacts
    first: Finding                   # the earliest timeout
    timed_out: frozenset[int]
    peer_closed: frozenset[int]      # ranks whose wait ended on a peer's closed connection
    ahead: frozenset[int]            # of those, ranks that had stepped past the waiting ranks
    late: frozenset[int]             # the rank that met the connections closed as it arrived
    hidden: frozenset[int]           # ranks whose output the log does not hold
    missing: tuple[int, ...]         # known ranks not in the collective, with output here
    waited_at: int | None            # the waiting ranks' last step (-1: none printed while others did)

    @property
    def waiters(self) -> list[int]:
        return sorted(self.timed_out)

    @property
    def closed_in(self) -> list[Finding]:
        """The lost connections of ranks that were in the collective with the waiting ranks."""
        return [f for f in self.live if f.rank in self.peer_closed - self.ahead - self.timed_out and lost_a_peer(f)]

    @property
    def waits(self) -> list[Finding]:
        """The waits to compare call by call: the closed connections count with the timeouts once three ranks
        or more are in them (two ranks are `_left_the_loop`'s reading)."""
        closed = self.closed_in
        enough = len(self.timed_out) + len({f.rank for f in closed}) >= 3
        return list(self.timeouts) + closed if enough else list(self.timeouts)


def picture_of(timeouts: list[Finding], live: list[Finding], facts: RankFacts,
               findings: list[Finding]) -> WaitPicture:
    timed_out = {f.rank for f in timeouts if f.rank is not None}
    # a rank whose wait ended on a peer's closed connection was in the collective too, unless it
    # had stepped past the waiting ranks (it skipped their collective and failed in a later one)
    peer_closed = {f.rank for f in live if f.rank is not None and lost_a_peer(f)}
    waited_at = _waited_at_step(timed_out, facts)
    ahead = {r for r in peer_closed if waited_at is not None and facts.last_step.get(r, -1) > waited_at}
    late = arrived_after_the_waits(timeouts, timed_out, live, facts, peer_closed - ahead - timed_out)
    in_collective = timed_out | (peer_closed - ahead - late)
    hidden = unseen_ranks(facts)
    killed_running = {r for r in hidden - in_collective if facts.exit_codes.get(r, 0) < 0}
    if len(killed_running) == 1 and facts.known - in_collective == killed_running:
        # Output filtered, but the summary shows every other rank's timeout (from its error file), and
        # this one only as stopped by the agent's signal: it never raised, it was still elsewhere.
        hidden = frozenset()
    return WaitPicture(tuple(timeouts), tuple(live), tuple(findings), facts, earliest(timeouts),
                       frozenset(timed_out), frozenset(peer_closed), frozenset(ahead), frozenset(late),
                       frozenset(hidden), tuple(sorted(facts.known - in_collective - hidden)), waited_at)


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


def arrived_after_the_waits(timeouts: list[Finding], timed_out: set[int], live: list[Finding], facts: RankFacts,
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
