"""The causal chain a report shows: the root, then the cascade (the first error of each other rank,
grouped by rule) and the teardown (the launcher's signals and summary), in order of appearance."""

from __future__ import annotations

from logtriage.analysis.findings import Finding
from logtriage.analysis.roots import ChainLink, ChainRole, RootCause, ranks_of


def build_chain(root: RootCause | None, findings: list[Finding]) -> tuple[ChainLink, ...]:
    links: list[ChainLink] = []
    root_ranks = set(root.ranks) if root else set()
    if root is not None and root.finding is not None:
        group = [f for f in findings if f.signature == root.finding.signature]
        links.append(ChainLink(root.rule, ChainRole.INITIATING, root.ranks, root.finding, len(group)))
    grouped: dict[tuple[str, ChainRole], list[Finding]] = {}
    seen_rank_cascade: set[int] = set()
    for finding in findings:
        if not finding.is_error or (root and root.finding is not None and finding.signature == root.finding.signature):
            continue
        if finding.is_teardown:
            grouped.setdefault((finding.rule.id, ChainRole.TEARDOWN), []).append(finding)
            continue
        if finding.rank is not None and (finding.rank in seen_rank_cascade or finding.rank in root_ranks):
            continue
        if finding.rank is not None:
            seen_rank_cascade.add(finding.rank)
        grouped.setdefault((finding.rule.id, ChainRole.CASCADE), []).append(finding)
    for (_, role), group in sorted(grouped.items(), key=lambda kv: (kv[0][1] is ChainRole.TEARDOWN, kv[1][0].seq)):
        links.append(ChainLink(group[0].rule, role, ranks_of(group), group[0], len(group)))
    return tuple(links)
