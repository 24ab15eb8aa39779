"""The rank of an unprefixed error, from the launcher's line beside it that names the rank.

Open MPI prints `MPI_ABORT was invoked on rank N in communicator MPI_COMM_WORLD` when a process
calls MPI_Abort (mpi4py's and Horovod's exception hooks do, after printing the traceback); without
`--tag-output` the traceback itself carries no rank, and the notice follows it within a few lines.
MPICH's and Intel MPI's bad-termination banner puts the rank on one line (`=   RANK 2 PID 1236
RUNNING AT node01`) and how that process ended on the next (`=   KILLED BY SIGNAL: 9 (Killed)`)."""

from __future__ import annotations

from dataclasses import replace

from logtriage.analysis.findings import Finding
from logtriage.analysis.roots import RootCause

ABORT_RULE = "launcher.mpi_abort"
MPICH_RANK_RULE = "launcher.mpich_rank_line"
# (the launcher's rule, where its line may stand from the error's line, what the report says)
_NAMERS = (
    # after the traceback's exception line: a blank line and the dashed rule, or the hook's notice
    (ABORT_RULE, range(1, 9), "the traceback has no rank of its own; the MPI_ABORT notice right after it "
                              "(line {line}) names rank {rank}, the process whose exception hook aborted the job"),
    # above the banner's signal or exit-code line (a blank line at most between)
    (MPICH_RANK_RULE, range(-2, 0), "mpiexec's bad-termination banner names rank {rank} on the line above "
                                    "(line {line})"),
)


def launcher_named_rank(root: RootCause, findings: list[Finding]) -> RootCause:
    f = root.finding
    if f is None or root.rank is not None or root.ranks or f.rank is not None or f.rule.id == ABORT_RULE:
        return root
    for rule_id, offsets, why in _NAMERS:
        near = [g for g in findings if g.rule.id == rule_id and g.source == f.source and g.line - f.line in offsets
                and g.captures.get("rank", "").isdigit()]
        if not near:
            continue
        named = min(near, key=lambda g: abs(g.line - f.line))
        low, high = sorted((f.line, named.line))
        # a line of some rank between the two would make the launcher's line another process's
        if any(g.rank is not None and g.source == f.source and low < g.line < high and g.rule.id != rule_id
               for g in findings):
            continue
        rank = int(named.captures["rank"])
        return replace(root, rank=rank, ranks=(rank,), reasons=root.reasons + (why.format(rank=rank, line=named.line),))
    return root
