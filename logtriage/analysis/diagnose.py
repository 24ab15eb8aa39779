"""From a scan to a diagnosis: streams resolved, findings attributed, the root cause chosen,
ranks given a status. Pure data in, pure data out (no rendering, no I/O).

The readings run in one order: the evidence gathered (`evidence`), the failure its errors point at read
against the rest of the log (`failure_readings`), the fallbacks where they point at none
(`fallback_readings`), the verdict and a hang's reading (`hang_verdict`), and a failure the run came back
from (`recovery_reading`)."""

from __future__ import annotations

from dataclasses import dataclass

from logtriage.analysis.chain import build_chain
from logtriage.analysis.childfailed import ChildFailure
from logtriage.analysis.environment import Environment, collect_environment
from logtriage.analysis.evidence import gather_evidence
from logtriage.analysis.failure_readings import read_failure
from logtriage.analysis.fallback_readings import read_fallbacks
from logtriage.analysis.findings import Finding
from logtriage.analysis.hang_verdict import read_verdict
from logtriage.analysis.recovery_reading import read_recovery
from logtriage.analysis.roots import ChainLink, RootCause, Verdict
from logtriage.analysis.statuses import StreamSummary, stream_statuses
from logtriage.catalog.loader import Catalog
from logtriage.demux.streams import StreamKey
from logtriage.scan_result import ScanResult


@dataclass(frozen=True)
class Diagnosis:
    verdict: Verdict
    root: RootCause | None
    chain: tuple[ChainLink, ...]
    findings: tuple[Finding, ...]
    streams: tuple[StreamSummary, ...]
    keys: tuple[StreamKey, ...]                 # slot -> stream
    failures: tuple[ChildFailure, ...]
    environment: Environment
    notes: tuple[str, ...]
    recovered: RootCause | None = None          # an earlier attempt's failure torchrun restarted from


def diagnose(scan: ScanResult, catalog: Catalog) -> Diagnosis:
    ev = gather_evidence(scan, catalog)
    root, verdict = read_verdict(ev, read_fallbacks(ev, read_failure(ev)))
    recovery = read_recovery(ev, root, verdict)
    root, verdict, recovered = recovery.root, recovery.verdict, recovery.recovered
    notes = list(recovery.notes)
    if scan.unreadable:
        notes.append("the input ended early (damaged or truncated): errors after that point are not in this report")
    chain = build_chain(root or recovered, ev.findings)
    notes += _child_failed_notes(ev.failures, root)
    env = collect_environment(scan.probes, scan.banner_lines, [s.name for s in scan.sources])
    streams = stream_statuses(ev.stream_stats, ev.findings, root or recovered, chain, verdict, ev.failures)
    return Diagnosis(verdict, root, chain, tuple(ev.findings), streams, tuple(ev.keys), tuple(ev.failures), env,
                     tuple(notes), recovered)

def _child_failed_notes(failures: list[ChildFailure], root: RootCause | None) -> list[str]:
    named = [f for f in failures if f.is_root_cause]
    if not named or root is None:
        return []
    entry = named[-1]
    what = f"exit code {entry.exitcode}" + (f" ({entry.signal})" if entry.signal else "")
    if entry.rank is not None and entry.rank in root.ranks and len(root.ranks) > 1:
        return [f"torchelastic's summary names rank {entry.rank} ({what}), one of the {len(root.ranks)} ranks "
                f"that raised the same error"]
    if root.rank is not None and entry.rank is not None and entry.rank != root.rank:
        return [f"torchelastic's summary names rank {entry.rank} ({what}) as the root cause; the evidence "
                f"points at rank {root.rank}: its summary picks the earliest exit at 1-second resolution"]
    return [f"torchelastic's summary names rank {entry.rank} ({what}) as the root cause"]
