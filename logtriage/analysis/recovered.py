"""A failure torchrun restarted the workers from (`--max-restarts`), after which the run finished:
the job succeeded, and the failure of the earlier attempt is reported as recovered, not as the
job's root cause."""

from __future__ import annotations

import re

from logtriage.analysis.childfailed import ChildFailure
from logtriage.analysis.findings import Finding
from logtriage.analysis.roots import RootCause
from logtriage.analysis.stopped import FINISHED_RULE
from logtriage.catalog.rule import Category
from logtriage.demux import launcher as L
from logtriage.demux.streams import StreamKey, StreamKind
from logtriage.scan_result import SlotStats

# lines the run-finished rule reads that a failing process prints too (its process group's
# destructor "has NOT been destroyed", "destroy_process_group() was not called", NCCL's
# "Destroy COMPLETE" as a communicator is torn down)
_NOT_AN_END = re.compile(r"destroy", re.IGNORECASE)
# torchelastic's agent (LOGLEVEL=INFO): every worker of its group exited 0
GROUP_SUCCEEDED = re.compile(r"worker group successfully finished|WorkerState\.SUCCEEDED")


def restarted_then_finished(root: RootCause, findings: list[Finding], failures: list[ChildFailure],
                            attempts: set[int]) -> Finding | None:
    """The line saying the run finished, when the root's failure made torchrun restart the workers
    (a later attempt's output, or the agent's `failed (exitcode: ...)` line with no ChildFailedError
    after it) and no error came after that line; else None."""
    if root.finding is None or failures:
        return None
    after = root.finding.seq
    finish = next((f for f in findings if f.rule.id == FINISHED_RULE and f.seq > after
                   and not _NOT_AN_END.search(f.text)), None)
    if finish is None:
        return None
    if any(f.rule.id == "launcher.child_failed" for f in findings):
        return None
    # a later attempt's output, or the agent's report of the failure (the root itself, or after it)
    # with no ChildFailedError, and the run finished after it
    restarted = max(attempts, default=0) > root.finding.stream.attempt or any(
        f.stream.kind is StreamKind.LAUNCHER and after <= f.seq < finish.seq and _agent_saw_fail(f.text)
        for f in findings)
    # (the agent's report of the failure it restarted from is no later error, wherever its console
    # stands among the inputs: a `--log-dir` folder's files are read before the console beside it)
    later_error = any(f.seq > finish.seq and f.is_error and not f.is_teardown
                      and not (f.stream.kind is StreamKind.LAUNCHER and _agent_saw_fail(f.text)) for f in findings)
    return finish if restarted and not later_error else None


def caught_then_finished(root: RootCause, findings: list[Finding], failures: list[ChildFailure],
                         ranks: set[int]) -> Finding | None:
    """The last line saying a rank finished, when the script caught its errors, printed them and went
    on (`traceback.print_exc()` then `continue`): every rank of the run says it finished, after every
    error its own stream shows and after every error no stream claims, or the agent says its worker
    group succeeded after every error; and nothing of the launcher's reports a failed worker (exit
    codes, a ChildFailedError); else None."""
    if root.finding is None or failures:
        return None
    if any(f.stream.kind is StreamKind.LAUNCHER and f.is_error and not f.is_teardown for f in findings):
        return None
    finishes = [f for f in findings if f.rule.id == FINISHED_RULE and not _NOT_AN_END.search(f.text)]
    last_error = max((f.seq for f in findings if f.is_error and not f.is_teardown), default=-1)
    agent_done = [f for f in finishes if f.stream.kind is StreamKind.LAUNCHER and GROUP_SUCCEEDED.search(f.text)
                  and f.seq > last_error]
    # (an exception the workers caught: a NaN loss fails a run whose every worker exits 0)
    if agent_done and root.finding.exception_type and root.rule.category is not Category.NUMERICAL:
        return agent_done[0]     # the agent's own word that every worker of its group exited 0
    if len(ranks) < 2:
        return None
    last_finish = {f.rank: f.seq for f in finishes if f.rank is not None}
    if not finishes or not ranks <= last_finish.keys():
        return None
    for f in findings:
        if f.is_error and not f.is_teardown and f.seq > last_finish.get(f.rank, max(last_finish.values())):
            return None
    return max(finishes, key=lambda f: f.seq)


def _agent_saw_fail(text: str) -> bool:
    """The agent's report of a failed worker (`failed (exitcode: 1) local_rank: 1 (pid: ...)`), or
    of its restart; without a restart the first is followed by ChildFailedError."""
    return bool(L.FAILED.search(text) or L.RESTART.search(text))


def relaunched_then_finished(root: RootCause, findings: list[Finding], failures: list[ChildFailure],
                             stats: dict[StreamKey, SlotStats]) -> tuple[int, Finding] | None:
    """A job wrapper that ran torchrun again after it failed (`for attempt in 1 2 3`): the launcher
    facts make the new torchrun's workers a later attempt (LauncherFacts.observe); when that attempt's
    output starts after the failure and its summary, and the run finished with no error after that,
    the job succeeded and the failure is the earlier launch's. Returns the line where the later
    attempt's output starts and the line saying the run finished, else None."""
    f = root.finding
    if f is None:
        return None
    later = [s.first_line for k, s in stats.items() if k.kind is StreamKind.RANK and k.attempt > f.stream.attempt
             and s.first_line is not None and s.first_line[0] == f.source]
    ended = max([(c.source, c.line) for c in failures if c.source == f.source] + [(f.source, f.line)])
    if not later or min(later) <= ended:
        return None
    start = min(later)[1]
    after = [g for g in findings if g.source == f.source and g.line > start]
    if any(g.is_error and not g.is_teardown for g in after) or any(
            c.source == f.source and c.line > start for c in failures):
        return None
    finish = next((g for g in after if g.rule.id == FINISHED_RULE and not _NOT_AN_END.search(g.text)), None)
    return (start, finish) if finish is not None else None
