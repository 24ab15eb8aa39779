"""A rank that died first without a word: its progress stopped a step before every other rank's,
and the launcher saw it exit of its own accord (an `os._exit(1)`, a SIGKILL it did not send), while
another rank's error, printed in full, came from a later step. Ranks step together between
collectives, so the one whose steps stopped first failed first; the loud error is a second fault."""

from __future__ import annotations

from logtriage.analysis.childfailed import is_own_failure
from logtriage.analysis.findings import Finding
from logtriage.analysis.live_errors import RESTART_ECHOES
from logtriage.analysis.roots import RankFacts, RootCause
from logtriage.catalog.rule import Role
from logtriage.demux.streams import StreamKind


def silent_death_first(root: RootCause, findings: list[Finding], facts: RankFacts) -> RootCause:
    steps = facts.last_step
    if root.rank is None or root.finding is None or root.rule.role is Role.CASCADE_CANDIDATE \
            or root.rank not in steps or len(steps) < 3 or set(steps) != set(facts.known):
        return root
    said = {f.rank for f in findings if f.is_error and f.rank is not None and f.stream.kind is StreamKind.RANK}
    silent = [r for r, code in facts.exit_codes.items()
              if r != root.rank and is_own_failure(code) and r not in said and r in steps]
    if len(silent) != 1:
        return root
    rank = silent[0]
    if any(steps[rank] >= s for r, s in steps.items() if r != rank):
        return root
    exit_line = next((f for f in findings if f.rank == rank and f.attributed_by == "launcher" and f.is_error
                      and f.rule.role is not Role.CASCADE_CANDIDATE), None)
    if exit_line is None or any(f.rule.id in RESTART_ECHOES and f.source == exit_line.source
                                and root.finding.seq < f.seq < exit_line.seq for f in findings):
        return root     # (an exit of the attempt restarted after the root, which could not form the group again)
    return RootCause(exit_line.rule, exit_line, rank, (rank,), min(root.confidence, 0.45), (
        f"rank {rank} exited of its own accord (exit code {facts.exit_codes[rank]}) without a line of its own, "
        f"and its progress stopped at step {steps[rank]}, before every other rank's; rank {root.rank}'s "
        f"{root.rule.id} came later (its last step {steps[root.rank]}): a second fault, not the first",))
