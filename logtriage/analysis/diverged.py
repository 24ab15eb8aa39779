"""Collective timeouts that are really a mismatch: the ranks waited in different collectives, at one
sequence number or (the only two ranks) at two, so their code called collectives in different
orders."""

from __future__ import annotations

from logtriage.analysis.findings import Finding
from logtriage.analysis.roots import RootCause, ranks_of
from logtriage.catalog.loader import Catalog
from logtriage.catalog.rule import Category, Rule

MISMATCH_RULE = "dist.collective_mismatch"


def different_collectives_at_one_seq(root: RootCause, findings: list[Finding], catalog: Catalog) -> RootCause:
    """Ranks timed out at the same sequence number in different collectives (ALLREDUCE on some,
    BROADCAST on another, or the same op on tensors of different sizes): their code called
    collectives in different orders, a mismatch, not a slow rank. The rank(s) in the rarer
    collective took the other path."""
    if root.rule.category is not Category.COLLECTIVE_TIMEOUT:
        return root
    by_seq: dict[str, dict[str, list[Finding]]] = {}
    for f in findings:
        if f.category is Category.COLLECTIVE_TIMEOUT and f.captures.get("seq") and f.captures.get("op"):
            shape = f.captures["op"] + (f"(numel {f.captures['numel_in']})" if f.captures.get("numel_in") else "")
            by_seq.setdefault(f.captures["seq"], {}).setdefault(shape, []).append(f)
    split = next((ops for ops in by_seq.values() if _disjoint_ranks(ops)), None)
    rule = catalog.get(MISMATCH_RULE)
    if rule is None:
        return root
    if split is None:
        return _diverged_pair(root, findings, rule)
    odd = min(split.values(), key=len)
    ranks = ranks_of(odd)
    first = odd[0]
    ops = ", ".join(f"{op} on rank(s) {list(ranks_of(fs))}" for op, fs in split.items())
    return RootCause(rule, first, ranks[0] if len(ranks) == 1 else None, ranks, 0.6, (
        f"at collective #{first.captures['seq']} the ranks waited in different collectives ({ops}): "
        "their code called collectives in a different order",))


def _disjoint_ranks(ops: dict[str, list[Finding]]) -> bool:
    """Two or more collectives at one sequence number, each waited in by its own ranks (one rank's
    two lines about the same wait, one with the tensor size and one without, are not a split)."""
    ranks = [{f.rank for f in fs if f.rank is not None} for fs in ops.values()]
    return len(ranks) > 1 and all(ranks) and sum(map(len, ranks)) == len(set().union(*ranks))


def _diverged_pair(root: RootCause, findings: list[Finding], rule: Rule) -> RootCause:
    """The log's only two ranks each timed out first in another collective at another sequence
    number (rank 1 in _ALLGATHER_BASE #313, rank 0 in ALLREDUCE #315). A rank's works complete in
    order and only with its peer's matching work, so the two ranks' sequences of collectives had
    already parted: a mismatch, and neither rank alone is the one that strayed. A culprit the
    timeouts already named (a silent rank, a debug report's) stays."""
    if root.rank is not None:
        return root
    first: dict[int, Finding] = {}
    for f in findings:
        seq, op = f.captures.get("seq", ""), f.captures.get("op")
        if f.category is Category.COLLECTIVE_TIMEOUT and f.rank is not None and seq.isdigit() and op and (
                f.rank not in first or int(seq) < int(first[f.rank].captures["seq"])):
            first[f.rank] = f
    seen = {f.rank for f in findings if f.rank is not None}
    if len(first) != 2 or seen != set(first):
        return root
    a, b = sorted(first.values(), key=lambda f: int(f.captures["seq"]))
    if a.captures["seq"] == b.captures["seq"] or a.captures["op"] == b.captures["op"]:
        return root
    return RootCause(rule, a, None, tuple(sorted(first)), 0.5, (
        f"the only two ranks timed out in different collectives at different points: rank {a.rank} in "
        f"{a.captures['op']} #{a.captures['seq']}, rank {b.rank} in {b.captures['op']} #{b.captures['seq']}; "
        "works complete in order and only with the peer's matching work, so their sequences of "
        "collectives had parted (a rank-specific branch or uneven data)",))
