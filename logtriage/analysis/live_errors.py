"""Which errors are still live when the root is chosen (analysis/rootcause.py): the filters that set
aside what the program recovered from, what a wrapper re-raised, what a lost store or an earlier
restart explains; and whether the program went on from every error of the log."""

from __future__ import annotations

import re

from logtriage.analysis.findings import Finding
from logtriage.analysis.hangs import FINISHED_RULE
from logtriage.analysis.lived_through import launcher_reports, lived_through, progress_after, ranks_by_rule
from logtriage.analysis.roots import RankFacts
from logtriage.analysis.timestamps import clearly_before
from logtriage.catalog.rule import Category, Role
from logtriage.demux.streams import StreamKind

EXIT_RULE = "signal.exit_nonzero"   # a worker's exit code, and nothing else about it
# a line saying the program carried on with a substitute ("falling back to torch.optim.AdamW")
FALLBACK_RULE = "context.fallback"
FALLBACK_REACH = 3   # input lines after an error within which such a line is its recovery
FALLBACK_STREAM_REACH = 30   # the same, for a line of the error's own rank (others' lines between them)
# a process re-raising what its DataParallel replica, DataLoader worker or pin-memory thread raised
# (torch's ExceptionWrapper; "in background" is its default)
_RERAISE = re.compile(r"\bCaught \w+ in (?:replica \d+ on device \d+|DataLoader worker process \d+"
                      r"|pin memory thread for device \d+|background)\.?\s*$")
RERAISE_REACH = 200   # input lines after the re-raise within which its original traceback ends


def live_errors(findings: list[Finding], facts: RankFacts) -> list[Finding]:
    """The errors a root is chosen among: not teardown, not one the program said it recovered from,
    not a re-raise whose original error is there, not an agent's lost rendezvous that follows a lost
    store or failed collectives, not one a rank lived through, and after `--max-restarts` only
    the last attempt's."""
    live = _after_store_lost(_without_reraise_wrappers(_not_recovered(
        [f for f in findings if f.is_error and not f.is_teardown], findings)))
    return _final_attempt(_restart_echoes(lived_through(_thread_work_finished(live, findings, facts), facts)), facts)


def _without_reraise_wrappers(live: list[Finding]) -> list[Finding]:
    """DataParallel's and the DataLoader's re-raise (`RuntimeError: Caught RuntimeError in replica 0
    on device 0.`) is followed by the `Original Traceback` whose own error says more: the wrapper
    yields to an error found there."""
    wrappers = [f for f in live if _RERAISE.search(f.text)]
    if not wrappers:
        return live
    dropped = {id(w) for w in wrappers
               if any(g.source == w.source and 0 < g.line - w.line <= RERAISE_REACH and not _RERAISE.search(g.text)
                      and _in_original_traceback(g) for g in live)}
    return [f for f in live if id(f) not in dropped]


def _in_original_traceback(finding: Finding) -> bool:
    """Whether a finding after a re-raise can be the original error: not the launcher's report of
    the process's exit (an inner error no rule knows leaves the wrapper as the root)."""
    return finding.attributed_by != "launcher" and finding.rule.id != EXIT_RULE \
        and finding.category is not Category.UNKNOWN


KEEPALIVE_RULE = "dist.rendezvous_keepalive_lost"
RENDEZVOUS_RULE = "dist.rendezvous_connection"


def _final_attempt(live: list[Finding], facts: RankFacts) -> list[Finding]:
    """After `--max-restarts`, the errors of the last attempt that failed of its own accord: the
    failure the run ended on (an earlier attempt's, which torchrun restarted the workers from, is
    in the chain), without the launcher's reports from before it; a stall (its timeouts) counts.
    An attempt whose workers only lost their peers, or could not form the group again (gloo's connectFullMesh refused: the
    restarted workers read the last attempt's addresses from the agent's store), failed of the
    earlier attempt's failure; so did one whose workers only timed out in DDP's constructor, or only
    timed out before any of them printed progress (the restarted group never met again: its first
    collective waited on a worker that did not come back)."""
    own = [f for f in live if f.stream.kind is StreamKind.RANK and f.rule.id not in RESTART_ECHOES
           and (f.role is not Role.CASCADE_CANDIDATE or f.category is Category.COLLECTIVE_TIMEOUT)]
    last = max((f.stream.attempt for f in own), default=0)
    if not last:
        return live
    mine = [f for f in own if f.stream.attempt == last]
    begun = min(f.seq for f in mine)
    # (the earlier attempt's end: its ranks' errors and the agent's report of the worker it lost, `failed
    # (exitcode: -7) local_rank: 1`, which is where it ended when no rank's own line says why)
    progressed = _progressed_since(facts, [f for f in own if f.stream.attempt < last]
                                   + [f for f in live if f.stream.kind is StreamKind.LAUNCHER and f.seq < begun])
    if all(f.category is Category.COLLECTIVE_TIMEOUT and (f.last_frame in DDP_CONSTRUCTION_FRAMES or not progressed)
           for f in mine):
        dropped = {id(f) for f in mine}
        return [f for f in live if id(f) not in dropped
                and not (f.stream.kind is StreamKind.LAUNCHER and f.seq >= begun)]
    return [f for f in live if (f.stream.attempt == last if f.stream.kind is StreamKind.RANK
                                else f.seq >= begun or f.stream.kind is not StreamKind.LAUNCHER)]


def _progressed_since(facts: RankFacts, earlier: list[Finding]) -> bool:
    """Whether a progress line came after the earlier attempts' last error in its input (the restarted
    workers' steps, where their lines carry no attempt of their own)."""
    ends: dict[int, int] = {}
    for f in earlier:
        ends[f.source] = max(ends.get(f.source, 0), f.line)
    return not ends or any(facts.progress_end.get(source, 0) > end for source, end in ends.items())


RESTART_ECHOES = frozenset({"gloo.connect_full_mesh"})
# DDP's constructor's first collectives (its check of every rank's parameter shapes, the broadcast of rank 0's
# weights): a timeout there means the ranks never all reached the model
DDP_CONSTRUCTION_FRAMES = frozenset({"_verify_param_shape_across_processes", "_sync_module_states",
                                     "_sync_params_and_buffers"})


def _restart_echoes(live: list[Finding]) -> list[Finding]:
    """A group that could not form again (gloo's connectFullMesh refused) after the agent had reported
    a worker's failure in the same console is the restart's echo of that failure, even where the
    restarted workers' lines carry no rank (an error before `init_process_group` returned has no
    `[rankN]:` prefix), so no attempt is known for them: the agent restarts only after it reported a
    failure, and a first start that cannot connect fails before any such report."""
    reported = _first_by_source(f for f in live if f.stream.kind is StreamKind.LAUNCHER and f.rank is not None
                                and f.rule.id not in RESTART_ECHOES)
    echoes = [f for f in live if f.rule.id in RESTART_ECHOES and f.stream.kind is not StreamKind.RANK
              and f.source in reported and f.seq > reported[f.source]]
    if not echoes:
        return live
    # the agent's reports of the restarted workers' exits come after the echo and say no more
    since = _first_by_source(echoes)
    dropped = {id(f) for f in echoes}
    return [f for f in live if id(f) not in dropped and not (
        f.stream.kind is StreamKind.LAUNCHER and f.source in since and f.seq > since[f.source])]


def _first_by_source(findings) -> dict[int, int]:
    """Each source's earliest finding's place (seq) among these."""
    first: dict[int, int] = {}
    for f in findings:
        first[f.source] = min(first.get(f.source, f.seq), f.seq)
    return first


def _after_store_lost(live: list[Finding]) -> list[Finding]:
    """An agent whose rendezvous keep-alive already failed (the store's host went away) then fails
    to shut the rendezvous down for the same reason: that later RendezvousConnectionError of the
    launcher is the same loss, not a root of its own. Nor is an agent's lost rendezvous after
    workers' collectives had failed (timed out, or lost a peer): the store's host, another node's
    agent, went away with that failure (each node's console captured on its own). Before them, the
    lost store is what the workers' lost peers follow from (the store's node died)."""
    lost = [f.seq for f in live if f.rule.id == KEEPALIVE_RULE]
    # (a worker's own line, or its error file in its agent's summary)
    failed = [f for f in live if f.rank is not None and f.category in _IN_COLLECTIVES]
    if not lost and not failed:
        return live
    return [f for f in live if not (f.rule.id == RENDEZVOUS_RULE and f.stream.kind is StreamKind.LAUNCHER
                                    and ((lost and f.seq > min(lost)) or any(_came_before(g, f) for g in failed)))]


def _came_before(a: Finding, b: Finding) -> bool:
    """By their stamps where both have comparable ones, else by input order."""
    order = clearly_before(a.stamp, b.stamp)
    return a.seq < b.seq if order is None else order


_IN_COLLECTIVES = frozenset({Category.COLLECTIVE_TIMEOUT, Category.COLLECTIVE_ERROR})


def _not_recovered(live: list[Finding], findings: list[Finding]) -> list[Finding]:
    """Errors the program recovered from (a failed optional build followed by "falling back to
    ...") did not end the run, unless nothing else went wrong."""
    marks = [f for f in findings if f.rule.id == FALLBACK_RULE]
    if not marks:
        return live
    # right after the error, or a little later in the same rank's stream (other ranks' lines between)
    kept = [f for f in live if not any(m.source == f.source and 0 <= m.line - f.line <= (
        FALLBACK_STREAM_REACH if m.stream == f.stream and m.stream.kind is StreamKind.RANK else FALLBACK_REACH)
        for m in marks)]
    return kept or live


def _thread_work_finished(live: list[Finding], findings: list[Finding], facts: RankFacts) -> list[Finding]:
    """A thread's exception (`Exception in thread uploader:`) does not end its process; where its rank
    (for one no rank claims: every rank) then says the run finished, the work was done despite it,
    and whatever went wrong after is not that exception's failure."""
    finished = [f for f in findings if f.rule.id == FINISHED_RULE and f.rank is not None]
    if not finished:
        return live
    kept = [f for f in live if not f.in_thread or not _finished_after(f, finished, facts)]
    return kept if any(f.role in (Role.ROOT_CANDIDATE, Role.EITHER) for f in kept) else live


def _finished_after(finding: Finding, finished: list[Finding], facts: RankFacts) -> bool:
    ranks = {f.rank for f in finished if f.source == finding.source and f.line > finding.line}
    return finding.rank in ranks if finding.rank is not None else len(ranks) >= 2 and ranks >= facts.known


def went_on_from_every_error(findings: list[Finding], facts: RankFacts) -> bool:
    """Every error of the log is one its rank (or, for a line no rank claims, every rank) went on
    training from, or one the program said it recovered from."""
    live = _not_recovered([f for f in findings if f.is_error and not f.is_teardown], findings)
    reports, sharers = launcher_reports(live), ranks_by_rule(live)
    return all(progress_after(f, facts, reports, sharers) for f in live)
