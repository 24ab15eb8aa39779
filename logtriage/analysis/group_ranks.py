"""The rank of a root that several ranks' alike errors make, or whose line names none: the one that went
first among alike errors, rank 0 for a store server that could not listen, the rank that reports the same
kind of error or that the others waited for, the launcher's first failure, and the one rank that differed
from all the others (its collective, its shape, its model) or that a debug report names."""

from __future__ import annotations

from logtriage.analysis.findings import Finding
from logtriage.analysis.rank_evidence import (lone_speaker, mismatch_odd_one_out, model_odd_one_out, odd_one_out,
                                              rank_from_exit_codes, rank_reporting_the_same, rank_the_launcher_saw_fail,
                                              rank_the_timeouts_wait_for, refine_rank)
from logtriage.analysis.roots import RankFacts, RootCause
from logtriage.analysis.timeouts import named_culprit
from logtriage.catalog.rule import Category


def rank_among_alike(first: Finding, group: list[Finding], live: list[Finding], facts: RankFacts,
                      ranks: tuple[int, ...], dated: bool) -> tuple[int | None, list[str]]:
    """The same error on several ranks: the one that went first, where anything says so (its own
    earlier sign, the launcher's first report), else the lowest."""
    rank = first.rank
    shared = {Category.ENVIRONMENT: "the machine or the installation they share",
              Category.CRASH_SIGNAL: "something they all share (the code, a native library, the machine)",
              }.get(first.category, "a code or data bug shared by all")
    reasons = [f"the same error on {len(ranks)} ranks: {shared}"]
    first_text: dict[int, str] = {}
    for f in sorted(group, key=lambda f: f.seq):
        if f.rank is not None:
            first_text.setdefault(f.rank, f.text)
    if len(set(first_text.values())) <= 1:
        # the very same line everywhere: no rank went first, unless one rank logged its error earlier
        rank = first.rank if dated and first.rank is not None else min(ranks)
    elif rank is None:
        rank = min(ranks)
    if all(f.attributed_by == "launcher" for f in group) and facts.summary_root in ranks:
        rank = facts.summary_root   # only the launcher's reports: the one it observed first
    refined = refine_rank(first, live, ranks) or _a_step_behind(ranks, facts)
    if refined is not None:
        if refined[0] != rank:   # one rank's own sign came first: not a bug they all share
            reasons[-1] = f"the same error on {len(ranks)} ranks"
            reasons.append(refined[1])
        rank = refined[0]
    return rank, reasons


def _a_step_behind(ranks: tuple[int, ...], facts: RankFacts) -> tuple[int, str] | None:
    """Of ranks that raised the same error, the one whose last progress line is a step before every other's
    (which agree): it raised in that step, the others a step later (they cannot run ahead of a rank further
    than the collectives of one step allow)."""
    steps = {r: facts.last_step[r] for r in ranks if r in facts.last_step}
    if len(steps) != len(ranks) or len(ranks) < 3:
        return None
    low = min(steps.values())
    behind = [r for r, s in steps.items() if s == low]
    if len(behind) != 1 or len(set(steps.values())) != 2 or max(steps.values()) != low + 1:
        return None
    return behind[0], (f"rank {behind[0]}'s last progress line is step {low}, every other rank's step {low + 1}: "
                       "it raised a step before the others")


def rank_of_a_line_without_one(first: Finding, live: list[Finding], facts: RankFacts) -> tuple[int, str] | None:
    """An error line that carries no rank: the rank that reports the same kind of error, the one the others'
    timeouts waited for, the one the launcher saw fail first, the only one with an exit code of its own, the
    only rank in the log, or the only one whose own lines are in it."""
    for find, why in ((lambda: store_server_rank(first),
                       "the line carries no rank; only rank {} starts the rendezvous store's server in "
                       "init_process_group (`_create_c10d_store`, is_master = rank == 0), so the process whose server "
                       "could not listen is that rank"),
                      (lambda: rank_reporting_the_same(first, live),
                       "the line carries no rank; rank {} reports the same kind of error"),
                      (lambda: rank_the_timeouts_wait_for(first, live, facts),
                       "the line carries no rank; the other ranks waited for rank {} (in their collective, "
                       "or for its address in the store), which says nothing of its own"),
                      (lambda: rank_the_launcher_saw_fail(live),
                       "the line carries no rank; the launcher saw rank {} fail first"),
                      (lambda: rank_from_exit_codes(facts),
                       "rank {} is the only worker that failed with its own exit code"),
                      (lambda: next(iter(facts.known)) if len(facts.known) == 1 else None,
                       "rank {} is the only rank in this log"),
                      (lambda: lone_speaker(first, live, facts),
                       "rank {} is the only rank whose own lines are in this log, and it reports no "
                       "consequence of another rank's failure")):
        rank = find()
        if rank is not None:
            return rank, why.format(rank)
    return None


# init_process_group's env:// and tcp:// rendezvous: rank 0 alone starts the TCPStore's server there
# (torch 2's `_create_c10d_store`, the handlers themselves before it), every other rank connects as a client
STORE_SERVER_FRAMES = frozenset({"_create_c10d_store", "_env_rendezvous_handler", "_tcp_rendezvous_handler"})
PORT_IN_USE_RULE = "dist.port_in_use"


def store_server_rank(first: Finding) -> int | None:
    """Rank 0, for a store server that could not listen (the port taken) raised in init_process_group's
    own rendezvous, where only rank 0 starts one (not under torchrun's agent store: its workers are all
    clients, and the agent's own failure is in the elastic rendezvous' frames)."""
    return 0 if first.rule.id == PORT_IN_USE_RULE and first.last_frame in STORE_SERVER_FRAMES else None


def odd_rank_out(first: Finding, live: list[Finding], facts: RankFacts, rank: int | None, ranks: tuple[int, ...],
                  confidence: float, reasons: list[str]) -> RootCause:
    """The one rank that differed from all the others (a collective's fingerprint, the shape it passed, its
    model's parameter count), or the rank a debug report names, over the group's own rank."""
    odd = mismatch_odd_one_out(live)
    if odd is None:
        odd = odd_one_out(facts.reported_shapes)
    if odd is not None and first.category is Category.COLLECTIVE_MISMATCH:
        return RootCause(first.rule, first, odd, (odd,), confidence, (
            f"rank {odd} ran a different collective (op, shape or dtype) from every other rank",))
    odd = model_odd_one_out(live) if first.category is Category.DDP_USAGE else None
    if odd is not None:
        return RootCause(first.rule, first, odd, (odd,), confidence, (
            f"rank {odd} built a different model: its parameter count differs from every other rank's, "
            "which agree",))
    culprit = named_culprit(live)
    if culprit is not None and first.category in (Category.COLLECTIVE_TIMEOUT, Category.COLLECTIVE_ERROR,
                                                  Category.COLLECTIVE_MISMATCH):
        rank, ranks = culprit, (culprit,)
        reasons.append(f"a debug report names rank {culprit} as the one that lagged or differed")
    return RootCause(first.rule, first, rank, ranks, confidence, tuple(reasons))
