"""Per-stream status for the report's rank table: ok, failed, hung or killed, and the stream's role
(root, cascade, teardown) in the diagnosis, attempt by attempt."""

from __future__ import annotations

from dataclasses import dataclass

from logtriage.analysis.childfailed import ChildFailure, is_killed
from logtriage.analysis.findings import Finding
from logtriage.analysis.roots import ChainLink, ChainRole, RootCause, Verdict
from logtriage.demux.streams import StreamKey, StreamKind
from logtriage.scan_result import SlotStats


@dataclass(frozen=True)
class StreamSummary:
    key: StreamKey
    lines: int
    first_error: Finding | None
    last_step: int | None
    last_step_line: tuple[int, int] | None
    status: str                      # ok | failed | hung | killed | unknown
    role: str                        # root | cascade | teardown | none


def stream_statuses(stats: dict[StreamKey, SlotStats], findings: list[Finding], root: RootCause | None,
                    chain: tuple[ChainLink, ...], verdict: Verdict,
                    failures: list[ChildFailure]) -> tuple[StreamSummary, ...]:
    """Each stream's status and role: the root's ranks (in the root's attempt), the chain's cascade
    ranks, ranks with an error of their own, workers the launcher killed."""
    first_error: dict[StreamKey, Finding] = {}
    # a launcher's line about a rank goes to that rank's own stream (named by its node under srun or pdsh)
    rank_streams: dict[tuple[int, int], StreamKey] = {}
    for key in sorted(stats):
        if key.kind is StreamKind.RANK:
            rank_streams.setdefault((key.rank, key.attempt), key)
    for f in findings:
        if f.is_error and not f.is_teardown:
            own = f.stream.kind is StreamKind.RANK or f.rank is None
            key = f.stream if own else rank_streams.get((f.rank, f.stream.attempt),
                                                        StreamKey(StreamKind.RANK, f.rank, f.stream.attempt))
            first_error.setdefault(key, f)
    # (rank, attempt) pairs; attempt None: every attempt (a launcher's line names no attempt)
    root_ranks = {(r, _attempt(root.finding)) for r in root.ranks} if root else set()
    cascade_ranks = {(r, _attempt(link.first)) for link in chain if link.role is ChainRole.CASCADE for r in link.ranks}
    exit_by_rank = {f.rank: f.exitcode for f in failures if f.rank is not None}
    out = []
    keys = set(stats) | {k for k in first_error if k.kind is StreamKind.RANK}
    for key in sorted(keys):
        s = stats.get(key, SlotStats())
        err = first_error.get(key)
        status, role = "ok", "none"
        if key.kind is StreamKind.RANK:
            code = exit_by_rank.get(key.rank)
            if _in_attempt(key, root_ranks):
                status, role = ("hung" if verdict is Verdict.HUNG else "failed"), "root"
            elif err is not None or _in_attempt(key, cascade_ranks):
                status, role = "failed", "cascade"
            elif is_killed(code):
                status, role = "killed", "teardown"
            elif verdict is Verdict.HUNG:
                status = "hung"
            elif code not in (None, 0):
                status = "failed"
        elif err is not None:
            status = "failed"
        out.append(StreamSummary(key, s.lines, err, s.last_step, s.last_step_line, status, role))
    return tuple(out)


def _attempt(finding: Finding | None) -> int | None:
    """The attempt a rank's own line belongs to; None for a launcher's or an unattributed line."""
    return finding.stream.attempt if finding is not None and finding.stream.kind is StreamKind.RANK else None


def _in_attempt(key: StreamKey, pairs: set[tuple[int, int | None]]) -> bool:
    return (key.rank, key.attempt) in pairs or (key.rank, None) in pairs
