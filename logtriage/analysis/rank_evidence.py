"""Which rank an error belongs to when its own line does not say: the launcher's reports and
exit codes, the ranks that printed the same kind of error, the first rank whose progress shows
it, the odd one out of DETAIL's collective fingerprints, the ranks missing from a start-up barrier,
the only rank whose own lines are in an excerpt."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Hashable, Mapping

from logtriage.analysis.childfailed import is_own_failure
from logtriage.analysis.exception_names import short_type
from logtriage.analysis.findings import Finding
from logtriage.analysis.lost_peers import lost_a_peer
from logtriage.analysis.roots import RankFacts, earliest
from logtriage.analysis.wait_picture import arrived_after_the_waits
from logtriage.catalog.rule import Category, Layer, Role
from logtriage.demux.blocks import NCCL_PREFIX
from logtriage.demux.line_marks import OWN_RANK
from logtriage.scan_result import step_number


# What a rank says when its peer's socket went away: the peer left first.
PEER_LEFT_RULES = frozenset({"gloo.connection_closed", "gloo.connection_reset"})


def all_exited_alike(first: Finding, group: list[Finding], live: list[Finding], facts: RankFacts) -> tuple[int, ...]:
    """An unprefixed exception printed more than once (the copies may be glued together: the same
    type twice on a line) while every rank exited with the same code and no rank said anything
    else: every rank raised it (an import error, a bad argument), so it has no single culprit."""
    etype = short_type(first.exception_type)
    same = [f for f in live if f.rank is None and f.rule.id == first.rule.id]
    copies = sum(f.text.count(etype) for f in same) if etype else sum(f.signature == first.signature for f in same)
    codes = {facts.exit_codes.get(r) for r in facts.known}
    own = [f for f in live if f.rank is not None and f.rule.id not in _LAUNCHER_EXITS]
    if len(facts.known) >= 2 and copies >= 2 and len(codes) == 1 and (next(iter(codes)) or 0) > 0 and not own:
        return tuple(sorted(facts.known))
    return ()


_LAUNCHER_EXITS = frozenset({"signal.exit_nonzero", "signal.sigkill", "signal.sigsegv", "signal.sigabrt",
                             "signal.sigbus", "signal.other_signal", "launcher.spawn_child_error",
                             "sched.srun_task_exit"})


def rank_the_launcher_saw_fail(live: list[Finding]) -> int | None:
    """The first worker the launcher reported failing with its own exit (torchrun's
    `failed (exitcode: 1) local_rank: 1`, mp.spawn's process N, composer's `Rank N crashed`, srun's
    `task 3: Exited with exit code 1` where a task is a rank)."""
    exits = [f for f in live if f.rule.id in _LAUNCHER_EXITS and f.rank is not None]
    if not _one_srun_task_failed(live):
        exits = [f for f in exits if f.rule.id != "sched.srun_task_exit"]
    return min(exits, key=lambda f: f.seq).rank if exits else None


def rank_the_timeouts_wait_for(first: Finding, live: list[Finding], facts: RankFacts) -> int | None:
    """An unattributed error (an exception in a thread, a c10d connect error, printed without the
    rank's prefix) while the other ranks waited: it belongs to the rank they waited for, when that
    rank says nothing else of its own: the one rank that neither timed out in their collective nor
    lost the peer that gave up first (its thread died, so it stalled), or the one rank whose address they waited for in the store
    (`keys: /default_pg/0//cpu//0/2`: it never reached the store). The launcher then saw a
    waiting rank fail first."""
    if first.category in (Category.COLLECTIVE_TIMEOUT, Category.COLLECTIVE_ERROR):
        return None
    # the ranks that waited: timed out in a collective, or lost the peer that gave up waiting first; a rank that
    # timed out nowhere and met its peers' connections closed only after all of their timeouts arrived late
    late = _met_them_closed_after(live, facts)
    waited = {f.rank for f in live if f.rank is not None and f.rank not in late
              and f.category in (Category.COLLECTIVE_TIMEOUT, Category.COLLECTIVE_ERROR)}
    missing = facts.known - waited
    awaited = {int(m.group(1)) for f in live if (m := _AWAITED_RANK.search(f.captures.get("keys", "")))}
    if len(awaited) == 1 and awaited <= facts.known:
        candidate = next(iter(awaited))
    elif len(waited) >= 2 and len(missing) == 1:   # one waiting rank alone says little
        candidate = next(iter(missing))
    else:
        return None
    speaks = any(f.rank == candidate and f.rule.id not in _LAUNCHER_EXITS and not f.is_teardown
                 and not (f.rank in late and lost_a_peer(f)) for f in live)
    return None if speaks else candidate


def _met_them_closed_after(live: list[Finding], facts: RankFacts) -> set[int]:
    """The one rank that timed out nowhere while every other known rank did, and met its peers' connections closed
    only after all of their timeouts (wait_picture's reading of a late arrival; or the launcher's stop made its
    handler call a collective)."""
    waits = [f for f in live if f.rank is not None and f.category in (Category.COLLECTIVE_TIMEOUT,
                                                                      Category.COLLECTIVE_ERROR)]
    timeouts = [f for f in waits if f.category is Category.COLLECTIVE_TIMEOUT]
    timed_out = {f.rank for f in timeouts}
    closed = {f.rank for f in waits if f.rank not in timed_out and lost_a_peer(f)}
    # (its errors of a collective only: the launcher's report of its exit code is no error of its own)
    return arrived_after_the_waits(timeouts, timed_out, waits, facts, closed) if len(timeouts) >= 2 else set()


# the store key of a rank's address that gloo's connectFullMesh waits for: `/default_pg/0//cpu//0/2`
_AWAITED_RANK = re.compile(r"//(?:cpu|cuda)//\d+/(\d+)$")


def _one_srun_task_failed(live: list[Finding]) -> bool:
    """srun lists the tasks that ended badly in batches, not in the order they failed: its notices
    name the culprit only when they name one task (the others "Terminated" by srun)."""
    notices = [f for f in live if f.rule.id == "sched.srun_task_exit"]
    return all(f.rank is not None for f in notices) and len({f.rank for f in notices}) == 1


def missing_from_barrier(findings: list[Finding]) -> list[int]:
    """Ranks absent from a start-up barrier: every rank that arrived says so (`for rank: N ...
    (world_size=W, worker_count=C)`); when all C of them are in the log, the others are missing."""
    reporters = {int(f.captures["self_rank"]) for f in findings if f.captures.get("self_rank", "").isdigit()}
    world = max((int(f.captures["world_size"]) for f in findings if f.captures.get("world_size", "").isdigit()),
                default=0)
    arrived = max((int(f.captures["worker_count"]) for f in findings if f.captures.get("worker_count", "").isdigit()),
                  default=0)
    if not world or world > 65536 or not reporters or len(reporters) < arrived:
        return []
    return sorted(set(range(world)) - reporters)


def rank_reporting_the_same(first: Finding, live: list[Finding]) -> int | None:
    """An unattributed error (a CUDA kernel's assert printed without a prefix) belongs to the one
    rank that reports an error of the same category (its NCCL watchdog: 'CUDA error: device-side
    assert triggered')."""
    ranks = {f.rank for f in live if f.rank is not None and f.category is first.category}
    return next(iter(ranks)) if len(ranks) == 1 else None


def refine_rank(first: Finding, live: list[Finding], ranks: tuple[int, ...]) -> tuple[int, str] | None:
    """Among ranks sharing one error, an earlier single-rank sign of the same kind names the
    culprit (e.g. the rank whose loss went NaN first before every rank's grad-norm check failed);
    ranks that all waited in the store for one rank's address (`keys: /default_pg/0//cpu//0/2`)
    name that rank: it never published it (it took another rank's number, or never started).
    Returns the rank and why."""
    awaited = {int(m.group(1)) for f in live if f.rule.id == first.rule.id
               and (m := _AWAITED_RANK.search(f.captures.get("keys", "")))}
    if len(awaited) == 1 and awaited <= set(ranks):
        rank = next(iter(awaited))
        return rank, f"every rank waited in the store for rank {rank}'s address: it never published it"
    if (named := _rank_every_copy_names(first, live, ranks)) is not None:
        return named, f"every rank's copy of the error names rank {named} (`{first.text.strip()[:80]}`)"
    if (after_loss := _only_rank_not_after_a_lost_peer(first, live, ranks)) is not None:
        return after_loss
    if first.category is not Category.NUMERICAL:
        return None
    by_step = _first_step_per_rank([f for f in live if f.rule.id == first.rule.id and f.rank is not None])
    if by_step:
        lowest = min(by_step.values())
        went_first = [r for r, step in by_step.items() if step == lowest]
        if len(went_first) == 1 and len(by_step) > 1:
            # ranks print at their own pace: the step, not the line order, says who went first
            return went_first[0], f"rank {went_first[0]} showed it at an earlier step ({lowest}) than the others"
    # (the launcher summary's copy of a rank's error file is that error again, not a sign of its own)
    signs = [f for f in live if f.category is first.category and f.rank is not None
             and f.signature != first.signature and f.role is not Role.CASCADE_CANDIDATE
             and f.attributed_by != "launcher"]
    if not signs:
        return None
    sign = earliest(signs)
    return sign.rank, (f"rank {sign.rank} showed it on its own first (line {sign.line}: "
                       f"{sign.text.strip()[:80]}); the others' error is its spread")


def _rank_every_copy_names(first: Finding, live: list[Finding], ranks: tuple[int, ...]) -> int | None:
    """An error every rank raised alike after comparing notes (`ranks resumed from different steps [6, 6, 6, 2]:
    rank 3 loaded an older checkpoint`), each copy naming the same one rank: that rank is the odd one. A script's
    own label (`rank 2: loss is nan`) names each copy's own rank, so it names no one rank."""
    named: set[int] = set()
    printers: set[int] = set()
    for f in live:
        if f.signature == first.signature and f.rank is not None:
            found = {int(m.group(1)) for m in OWN_RANK.finditer(f.text)}
            if len(found) != 1:
                return None
            named |= found
            printers.add(f.rank)
    if len(named) != 1 or len(printers) < 2:
        return None
    rank = next(iter(named))
    return rank if rank in ranks else None


def _only_rank_not_after_a_lost_peer(first: Finding, live: list[Finding],
                                     ranks: tuple[int, ...]) -> tuple[int, str] | None:
    """Ranks sharing one error, all but one of which lost a peer before their copy of it (a caught
    `Connection closed by peer` a trainer logged and went on from): they met the error because that
    one rank's went first and left them; the one rank whose copy no lost peer came before is the
    culprit."""
    own: dict[int, int] = {}
    for f in live:
        if f.signature == first.signature and f.rank in ranks:
            own[f.rank] = min(own.get(f.rank, f.seq), f.seq)
    lost = {f.rank for f in live if f.rule.id in PEER_LEFT_RULES and f.rank in own and f.seq < own[f.rank]}
    alone = set(own) - lost
    if len(own) < 3 or len(alone) != 1:
        return None
    rank = next(iter(alone))
    return rank, (f"ranks {', '.join(map(str, sorted(lost)))} lost a peer before their copy of the error; "
                  f"rank {rank}'s came with no loss before it: the others met it after rank {rank} left them")


def _first_step_per_rank(findings: list[Finding]) -> dict[int, int]:
    steps: dict[int, int] = {}
    for f in sorted(findings, key=lambda f: f.seq):
        step = step_number(f.text)
        if step is not None and f.rank is not None:
            steps.setdefault(f.rank, step)
    return steps


def mismatch_odd_one_out(live: list[Finding]) -> int | None:
    """With DETAIL, each rank names its own collective fingerprint and another rank's. The rank
    whose fingerprint differs from the majority's is the one running different code or data."""
    return odd_one_out(_named_by_rank(live, "dist.collective_mismatch", ("op", "shape", "dtype"),
                                      ("other_op", "other_shape", "other_dtype")))


def model_odd_one_out(live: list[Finding]) -> int | None:
    """DDP's constructor check: each rank names its own parameter count and one other rank's
    (`Rank 3 has 4 params, while rank 0 has inconsistent 6 params`). The rank whose count differs
    from all the others' built a different model; every rank raising the same error hides it."""
    return odd_one_out(_named_by_rank(live, "ddp.param_shape_mismatch", ("params",), ("other_params",)))


def _named_by_rank(live: list[Finding], rule_id: str, own: tuple[str, ...], other: tuple[str, ...]) -> dict[int, tuple]:
    """What a rule's lines say of their own rank (the `own` captures) and of the other rank they
    name (the `other` captures), by rank: a rank's own first saying, else the first another rank
    says of it (DETAIL's check of a barrier against rank 0 names rank 0's `GATHER` of sequence
    number 0, not the collective rank 0 itself reports)."""
    lines = [f.captures for f in live if f.rule.id == rule_id and "self_rank" in f.captures
             and "other_rank" in f.captures]
    values: dict[int, tuple] = {}
    for c in lines:
        values.setdefault(int(c["self_rank"]), tuple(c.get(k) for k in own))
    for c in lines:
        values.setdefault(int(c["other_rank"]), tuple(c.get(k) for k in other))
    return values


def odd_one_out(by_rank: Mapping[int, Hashable]) -> int | None:
    """Of three or more ranks, the one whose value (a collective's fingerprint, the input shape a
    framework's shape check lists for each process) differs from all the others', which agree."""
    counts = Counter(by_rank.values())
    if len(by_rank) < 3 or len(counts) != 2:
        return None
    odd = [r for r, value in by_rank.items() if counts[value] == 1]
    return odd[0] if len(odd) == 1 else None


def lone_speaker(first: Finding, live: list[Finding], facts: RankFacts) -> int | None:
    """An excerpt where one rank's own lines are all there is (a kernel's assert printed without
    a prefix, then rank 104's traceback cut before its exception): the unattributed error is that
    rank's, unless it reports a consequence of another rank's failure (then it is a victim)."""
    if len(facts.speaking) != 1 or first.rule.layer in (Layer.LAUNCHER, Layer.CONTAINER):
        return None   # a launcher's or scheduler's line is about a node or the job, not a rank
    if first.text.startswith("[") or NCCL_PREFIX.match(first.text):
        return None   # a label of its own the tool could not read, or NCCL's host:pid:tid: another process
    rank = next(iter(facts.speaking))
    victim = any(f.rank == rank and f.role is Role.CASCADE_CANDIDATE for f in live)
    return None if victim else rank


def rank_from_exit_codes(facts: RankFacts) -> int | None:
    own = [r for r, code in facts.exit_codes.items() if is_own_failure(code)]
    return own[0] if len(own) == 1 else None
