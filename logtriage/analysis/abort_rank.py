"""The rank of an unprefixed error, from the launcher's report beside it that names the rank.

MPICH's and Intel MPI's bad-termination banner puts the rank on one line (`=   RANK 2 PID 1236
RUNNING AT node01`) and how that process ended on the next (`=   KILLED BY SIGNAL: 9 (Killed)`):
the signal line is that rank's.

Open MPI prints `MPI_ABORT was invoked on rank N in communicator MPI_COMM_WORLD` when a process
calls MPI_Abort (mpi4py's and Horovod's exception hooks do, after printing the traceback); without
`--tag-output` the traceback itself carries no rank, and the banner follows it within a few lines."""

from __future__ import annotations

from dataclasses import replace

from logtriage.analysis.findings import Finding
from logtriage.analysis.roots import RootCause

ABORT_RULES = frozenset({"launcher.mpi_abort"})
MPICH_RANK_RULE = "launcher.mpich_rank_line"
BANNER_REACH = 2   # the rank line, then the signal or exit code line (a blank line at most between)
# lines from the traceback's exception line to the banner: a blank line and the dashed rule, or
# the hook's own one-line notice
ABORT_REACH = 8


def abort_names_rank(root: RootCause, findings: list[Finding]) -> RootCause:
    f = root.finding
    if f is None or root.rank is not None or root.ranks or f.rank is not None or f.rule.id in ABORT_RULES:
        return root
    after = [g for g in findings if g.rule.id in ABORT_RULES and g.source == f.source
             and 0 < g.line - f.line <= ABORT_REACH and g.captures.get("rank", "").isdigit()]
    if not after:
        return root
    banner = min(after, key=lambda g: g.line)
    # a line of some rank between the two would make the banner another process's
    if any(g.rank is not None and g.source == f.source and f.line < g.line < banner.line
           and g.rule.id not in ABORT_RULES for g in findings):
        return root
    rank = int(banner.captures["rank"])
    return replace(root, rank=rank, ranks=(rank,), reasons=root.reasons + (
        f"the traceback has no rank of its own; the MPI_ABORT notice right after it (line {banner.line}) names "
        f"rank {rank}, the process whose exception hook aborted the job",))


def banner_rank(root: RootCause, findings: list[Finding]) -> RootCause:
    f = root.finding
    if f is None or root.rank is not None or root.ranks or f.rank is not None or not f.text.startswith("="):
        return root
    above = [g for g in findings if g.rule.id == MPICH_RANK_RULE and g.source == f.source
             and 0 < f.line - g.line <= BANNER_REACH and g.captures.get("rank", "").isdigit()]
    if not above:
        return root
    line = max(above, key=lambda g: g.line)
    rank = int(line.captures["rank"])
    return replace(root, rank=rank, ranks=(rank,), reasons=root.reasons + (
        f"mpiexec's bad-termination banner names rank {rank} on the line above (line {line.line})",))
