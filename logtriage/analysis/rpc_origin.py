"""An error raised inside a function called over torch.distributed.rpc happened on the worker that
ran it: that worker prints it under `On WorkerInfo(id=N, name=...)` and usually goes on serving,
while the caller re-raises the text and dies (it is torchrun's Root Cause, and an abort may follow).
A distributed backward says `Error on Node N:` the same way. Worker N (its RPC rank, the rank
torchrun gave it in these jobs) is where the failure started."""

from __future__ import annotations

import re
from dataclasses import replace

from logtriage.analysis.findings import Finding
from logtriage.analysis.roots import RankFacts, RootCause, earliest
from logtriage.catalog.rule import Category

# the roots a remote error shows as on the caller: its re-raise, or how the caller then ended
_CALLER_ENDS = frozenset({Category.PYTHON_EXCEPTION, Category.CRASH_SIGNAL, Category.UNKNOWN})
# the worker a line names: the rule's own lines, and (where an exception rule took the line first: the
# caller's re-raise) the same marks inside an exception's message (context.rpc_remote_origin's patterns)
_NAMED_WORKER = re.compile(r"On WorkerInfo\(id=(\d+), name=[^,)]*\):|\bError on Node (\d+): ")


def remote_origin(root: RootCause, findings: list[Finding], facts: RankFacts) -> RootCause:
    """A root that is a remote call's error (or the caller's end after it) moves to the one worker
    the RPC layer names as where it raised, with that worker's own exception where it printed one."""
    marks = {id(f): m for f in findings if (m := _NAMED_WORKER.search(f.text))}
    origins = [f for f in findings if id(f) in marks]
    named = {int(marks[id(f)].group(1) or marks[id(f)].group(2)) for f in origins}
    if len(named) != 1 or (root.rule.category not in _CALLER_ENDS and root.rank is not None):
        return root
    worker = next(iter(named))
    if (facts.known and worker not in facts.known) or any(
            f.rank is not None and f.rank != worker for f in origins if not _is_echo(f)):
        return root    # the worker's own print sits on another rank's stream: the id is no rank here
    first = earliest(origins)
    why = (f"the error was raised inside a function called over torch.distributed.rpc on worker {worker} "
           f"(line {first.line}: `{first.text.strip()[:100]}`)")
    if root.rule.category not in _CALLER_ENDS:   # a specific reading of the remote error: only its rank was missing
        return replace(root, rank=worker, ranks=(worker,), reasons=root.reasons + (why,))
    # (the origin rule's own lines are context, never an error: is_error leaves them out)
    errors = [f for f in findings if f.category is Category.PYTHON_EXCEPTION and f.is_error]
    own = [f for f in errors if f.rank in (None, worker) and f.source == first.source and f.line >= first.line
           and id(f) not in marks]
    chosen = earliest(own) if own else next((f for f in errors if id(f) in marks), None)
    if chosen is None or (root.rank == worker and root.finding is chosen):
        return root
    return RootCause(chosen.rule, replace(chosen, rank=worker), worker, (worker,), min(root.confidence, 0.6),
                     root.reasons + (why + "; the caller only re-raised it",))


def _is_echo(finding: Finding) -> bool:
    """The caller's re-raise of the remote text (the mark inside its own exception's message), not
    the worker's own print of it."""
    return not finding.text.lstrip().startswith("On WorkerInfo(")
