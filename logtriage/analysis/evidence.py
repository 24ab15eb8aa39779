"""What every reading of a log starts from: the scan's streams resolved to ranks, the findings
attributed, the launcher's child-failure summary parsed, and the facts per rank, gathered once."""

from __future__ import annotations

from dataclasses import dataclass

from logtriage.analysis.childfailed import ChildFailure, parse_child_failures
from logtriage.analysis.findings import Finding, resolve_findings
from logtriage.analysis.lone_notice import stop_notices
from logtriage.analysis.nccl_ranks import attribute_by_nccl_pid
from logtriage.analysis.rank_facts import merge_stats, rank_facts
from logtriage.analysis.roots import RankFacts
from logtriage.analysis.signal_readings import agent_sigkills, notices_in_teardown, unsent_sigterms
from logtriage.catalog.loader import Catalog
from logtriage.demux.streams import StreamKey
from logtriage.scan_result import ScanResult, SlotStats


@dataclass(frozen=True)
class Evidence:
    scan: ScanResult
    catalog: Catalog
    keys: list[StreamKey]                       # slot -> stream
    failures: list[ChildFailure]                # torchelastic's summary, entry by entry
    findings: list[Finding]                     # every rule's hit, attributed to its stream
    notices: list[Finding]                      # the workers' own notices that they were sent a stop
    stream_stats: dict[StreamKey, SlotStats]
    facts: RankFacts


def gather_evidence(scan: ScanResult, catalog: Catalog) -> Evidence:
    keys = scan.slots.resolve(scan.facts.pid_to_rank(), scan.facts.attempt_of_segment, scan.facts.host_rank,
                             scan.facts.console_rank)
    failures = parse_child_failures(scan.launcher_lines)
    teardown_pids = frozenset(scan.facts.teardown_pids)
    findings = agent_sigkills(unsent_sigterms(attribute_by_nccl_pid(resolve_findings(scan, keys, failures)), catalog,
                                              teardown_pids), catalog)
    notices = stop_notices(findings)
    findings = notices_in_teardown(findings)
    stream_stats = merge_stats(scan, keys)
    facts = rank_facts(stream_stats, failures, findings, scan.world_size, teardown_pids)
    return Evidence(scan, catalog, keys, failures, findings, notices, stream_stats, facts)
