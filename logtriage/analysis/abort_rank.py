"""The rank of an unprefixed traceback, from the launcher's report right after it that names the
rank which ended the job.

Open MPI prints `MPI_ABORT was invoked on rank N in communicator MPI_COMM_WORLD` when a process
calls MPI_Abort (mpi4py's and Horovod's exception hooks do, after printing the traceback); without
`--tag-output` the traceback itself carries no rank, and the banner follows it within a few lines."""

from __future__ import annotations

from dataclasses import replace

from logtriage.analysis.findings import Finding
from logtriage.analysis.roots import RootCause

ABORT_RULES = frozenset({"launcher.mpi_abort"})
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
