"""Errors a program printed and went on from, as its next lines say: NCCL could not open one
InfiniBand device and then uses another (`NET/IB : Using [0]mlx5_1:1/RoCE`, `Using network IB`);
Inductor's autotuner hit a CUDA error with one candidate kernel and says `Ignoring this choice.`

A rule names the rules whose findings mean that (`recovered_by`); such a finding up to
`WINDOW` lines later, from the same process, makes the earlier one no error."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from logtriage.analysis.findings import Finding

WINDOW = 30
# NCCL's line header, `host:pid:tid [device]`: lines of one process, also where no prefix says which
_NCCL_PID = re.compile(r"^[\w.-]+:(\d+):\d+ \[")


def mark_went_on(findings: list["Finding"]) -> list["Finding"]:
    """The findings, those a later finding of their rule's `recovered_by` rules follows marked."""
    wanted = {rid for f in findings for rid in f.rule.recovered_by}
    if not wanted:
        return findings
    later = [f for f in findings if f.rule.id in wanted]
    return [replace(f, went_on=True) if f.rule.recovered_by and _followed(f, later) else f for f in findings]


def _followed(finding: "Finding", later: list["Finding"]) -> bool:
    pid = _pid(finding.text)
    return any(other.rule.id in finding.rule.recovered_by and other.stream == finding.stream
               and other.source == finding.source and 0 < other.line - finding.line <= WINDOW
               and (pid is None or _pid(other.text) in (None, pid))
               for other in later)


def _pid(text: str) -> str | None:
    m = _NCCL_PID.match(text)
    return m.group(1) if m else None
