"""Verdicts for runs without an error line: hangs (ranks waiting at a barrier, progress that
stopped unevenly, output that stops in or right after NCCL set-up) and start-ups whose processes
never formed the world (ranks announced twice or never)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace

from logtriage.analysis.findings import Finding
from logtriage.analysis.nccl_ranks import SETUP_RULE
from logtriage.analysis.rank_evidence import missing_from_barrier
from logtriage.analysis.roots import RankFacts, RootCause
from logtriage.catalog.loader import Catalog
from logtriage.rank_ranges import ranges
from logtriage.catalog.rule import Category, Role, Rule, Severity
from logtriage.scan_result import ScanResult


def waiting(findings: list[Finding], facts: RankFacts) -> RootCause | None:
    """Nothing failed, but ranks say they are waiting for others (a start-up barrier short of
    workers): the run hangs, and the ranks that do not say so are the stuck ones."""
    waiting = [f for f in findings if f.category is Category.HANG and f.rule.severity is Severity.WARNING]
    if not waiting:
        return None
    first = waiting[0]
    world = max((int(f.captures["world_size"]) for f in waiting if f.captures.get("world_size", "").isdigit()),
                default=0)
    arrived = max((int(f.captures["worker_count"]) for f in waiting if f.captures.get("worker_count", "").isdigit()),
                  default=0)
    missing = missing_from_barrier(waiting)
    if not world and not arrived:   # a wait that is not a barrier's (a scheduler's, a store's)
        named = sorted({int(r) for f in waiting for r in re.findall(r"\d+", f.captures.get("missing_ranks", ""))})
        reasons = [f"{first.rule.title}; nothing failed, and the log ends while it waits"]
        if named:
            reasons.append(f"rank(s) {ranges(named, limit=8)} are named as missing: look at what they were doing")
        return RootCause(first.rule, first, named[0] if len(named) == 1 else None, tuple(named), 0.45,
                         tuple(reasons))
    reasons = [f"{arrived or len(waiting)} of {world or '?'} ranks reached the barrier and wait; nothing failed"]
    if missing and len(missing) <= 8:
        reasons.append(f"rank(s) {', '.join(map(str, missing))} never arrived: look at what they were doing")
    rank = missing[0] if len(missing) == 1 else None
    return RootCause(first.rule, first, rank, tuple(missing), 0.45, tuple(reasons))


BEHIND_STEPS = 2      # a rank this many steps short of the furthest one is behind (one step is ordinary skew),
# or a lone rank one step short of all the others, three or more (`rank 2 step 2` its last line while ranks 0, 1, 3
# and 4 printed step 3: its peers went on to the next collective and wait there; cpu_adhoc 507th batch)


def hang_from_progress(facts: RankFacts, catalog: Catalog) -> RootCause | None:
    """No error at all, but the ranks' progress stopped unevenly: some rank is stuck."""
    steps = facts.last_step
    if len(steps) < 2:
        return None
    low, high = min(steps.values()), max(steps.values())
    behind = tuple(sorted(r for r, s in steps.items() if s == low))
    if high - low < BEHIND_STEPS and not (high - low == 1 and len(behind) == 1 and len(steps) >= 3):
        return None
    rule = catalog.get("hang.no_progress") or fallback_rule("hang.no_progress", Category.HANG,
                                                            "Output stopped: no error, ranks' progress diverged")
    return RootCause(rule, None, behind[0] if len(behind) == 1 else None, behind, 0.45, (
        f"no error line; rank(s) {', '.join(map(str, behind))} stopped at step {low} while others reached step {high}",))


def stalled_in_nccl_init(scan: ScanResult, findings: list[Finding], facts: RankFacts,
                          catalog: Catalog) -> RootCause | None:
    """No error and no progress, and the output stops during NCCL's set-up (INFO lines start, no
    communicator completes) or right after it (every one completed, nothing follows)."""
    init = [f for f in findings if f.rule.id == SETUP_RULE]
    started = [f for f in init if f.captures.get("bootstrap_if")]
    completed = [f for f in init if f.captures.get("complete")]
    registered = [f for f in findings if f.rule.id == "launcher.lightning_member" and "registered" in f.captures]
    if facts.last_step:
        return None
    if registered and not completed and _near_the_end(scan, registered[-1], 10):
        rule = catalog.get("hang.after_nccl_init") or fallback_rule(
            "hang.after_nccl_init", Category.HANG, "Output stopped right after the process group formed")
        return RootCause(rule, registered[-1], None, (), 0.35, (
            "every process registered (the group formed) within the log's last 10 lines, and no step, "
            "error or exit came after",))
    if not init:
        return None
    last = max(init, key=lambda f: (f.source, f.line))
    if completed and _near_the_end(scan, last, 50):
        rule = catalog.get("hang.after_nccl_init") or fallback_rule(
            "hang.after_nccl_init", Category.HANG, "Output stopped right after NCCL built its communicators")
        return RootCause(rule, completed[-1], None, (), 0.35, (
            f"{len(completed)} communicator(s) reached `Init COMPLETE` within the log's last 50 lines, "
            "and no step, error or exit came after",))
    if not started or completed:
        return None
    rule = catalog.get("hang.nccl_init_stalled") or fallback_rule(
        "hang.nccl_init_stalled", Category.HANG, "Output stopped while NCCL was setting up its communicator")
    return RootCause(rule, started[-1], None, (), 0.4, (
        f"NCCL started in {len(started)} process(es) but no communicator reached `Init COMPLETE`, "
        "and nothing (no step, no error, no exit) came after",))


def _near_the_end(scan: ScanResult, finding: Finding, lines: int) -> bool:
    return (finding.source == len(scan.indexes) - 1
            and len(scan.indexes[finding.source].offsets) - finding.line <= lines)


def world_incomplete(findings: list[Finding], catalog: Catalog, stop: RootCause | None) -> RootCause | None:
    """Processes announced their global ranks (Lightning's MEMBER lines) and the ranks do not
    make up the world: repeated or missing ranks keep init_process_group waiting."""
    if any(f.rule.id == "launcher.lightning_member" and "registered" in f.captures for f in findings):
        return None   # the group formed: members not shown were cut from the paste
    members = [f for f in findings if f.rule.id == "launcher.lightning_member" and f.rank is not None]
    worlds = {int(f.captures["world"]) for f in members if f.captures.get("world", "").isdigit()}
    if not members or len(worlds) != 1:
        return None
    world = worlds.pop()
    claimed = _announcers(members)
    repeated = sorted(r for r, n in claimed.items() if n > 1)
    missing = sorted(set(range(world)) - claimed.keys()) if world <= 65536 else []
    if not repeated and not missing:
        return None
    if not repeated and stop is None:
        # ranks missing and nothing else: the group is still forming (or stuck forming), a hang;
        # a job stopped while it waited is kept as the misconfiguration it usually is
        rule = catalog.get("hang.world_not_joined") or fallback_rule(
            "hang.world_not_joined", Category.HANG, "Output stopped while processes waited for the rest to join")
    else:
        rule = catalog.get("launcher.world_incomplete") or fallback_rule(
            "launcher.world_incomplete", Category.LAUNCH_USAGE, "The processes' global ranks do not make up the world")
    first = next(f for f in members if f.rank in repeated) if repeated else members[0]
    reasons = [f"a world of {world}: {len(claimed)} distinct global rank(s) announced"]
    if repeated:
        reasons.append(f"rank(s) {ranges(repeated, limit=8)} announced more than once")
    if missing:
        reasons.append(f"rank(s) {ranges(missing, limit=8)} never announced")
    if stop is not None:
        reasons.append(f"then the job was stopped ({stop.rule.id}) while the others waited")
    if rule.category is Category.HANG:   # the missing ranks are the ones to look at
        return RootCause(rule, first, missing[0] if len(missing) == 1 else None, tuple(missing), 0.4, tuple(reasons))
    return RootCause(rule, first, None, tuple(repeated), 0.5, tuple(reasons))


_DIGITS = re.compile(r"\d+")


def _announcers(members: list[Finding]) -> Counter:
    """How many processes announced each global rank: its announcements in one format (the text before the
    announcement, digits aside). One record printed by two log handlers (`INFO: Initializing distributed: ...` and
    `2026-12-07 21:47:25,822 INFO lightning.fabric...: Initializing distributed: ...`) is one process's."""
    formats = Counter((f.rank, _DIGITS.sub("0", f.text.split("Initializing distributed", 1)[0])) for f in members)
    claimed: Counter = Counter()
    for (rank, _), count in formats.items():
        claimed[rank] = max(claimed[rank], count)
    return claimed


def fallback_rule(rule_id: str, category: Category, title: str) -> Rule:
    return Rule(id=rule_id, title=title, category=category, role=Role.ROOT_CANDIDATE, patterns=(), derived=True)


EXIT_STALLED = "hang.exit_stalled"
FINISHED_RULE = "context.run_finished"


def finished_then_stopped(root: RootCause, findings: list[Finding], catalog: Catalog) -> RootCause:
    """A job the scheduler or a person stopped (`root`, an external stop) after a line saying the
    training had finished, with no error between: the processes finished their work and never
    exited, and the stop ended a hang at exit (a process group never destroyed, a profiler or a
    logger that does not shut down, a non-daemon thread)."""
    stop = root.finding
    if stop is None or root.rule.category is not Category.EXTERNAL_STOP:
        return root
    finished = next((f for f in findings if f.rule.id == FINISHED_RULE and f.source == stop.source
                     and f.line < stop.line), None)
    if finished is None or any(f.fails_beyond_a_stop and f.source == stop.source and finished.line < f.line < stop.line
                               for f in findings):
        return root
    rule = catalog.get(EXIT_STALLED) or fallback_rule(
        EXIT_STALLED, Category.HANG, "The run finished its work but never exited, until it was stopped")
    return replace(root, rule=rule, confidence=min(root.confidence, 0.45), reasons=(
        f"line {finished.line} says the run finished, and nothing failed after it; the processes did not exit "
        f"until {root.rule.id} at line {stop.line} stopped them: the stop ended a hang at exit",))
