"""Errors a program printed and went on from, as its next lines say: NCCL could not open one
InfiniBand device and then uses another (`NET/IB : Using [0]mlx5_1:1/RoCE`, `Using network IB`);
Inductor's autotuner hit a CUDA error with one candidate kernel and says `Ignoring this choice.`

A rule names the rules whose findings mean that (`recovered_by`); such a finding up to
`WINDOW` lines later, from the same process, makes the earlier one no error."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from logtriage.demux.blocks import NCCL_PREFIX

if TYPE_CHECKING:
    from logtriage.analysis.findings import Finding

WINDOW = 30


def mark_went_on(findings: list["Finding"]) -> list["Finding"]:
    """The findings, those a later finding of their rule's `recovered_by` rules follows marked."""
    wanted = {rid for f in findings for rid in f.rule.recovered_by}
    if not wanted:
        return findings
    later = [f for f in findings if f.rule.id in wanted]
    return [replace(f, went_on=True) if f.rule.recovered_by and _followed(f, later) else f for f in findings]


def _followed(finding: "Finding", later: list["Finding"]) -> bool:
    process = _process(finding.text)
    return any(other.rule.id in finding.rule.recovered_by and other.stream == finding.stream
               and other.source == finding.source and 0 < other.line - finding.line <= WINDOW
               and (process is None or _process(other.text) in (None, process))
               for other in later)


def _process(text: str) -> tuple[str, str] | None:
    """(host, pid) of an NCCL line: its lines are one process's also where no prefix says which."""
    m = NCCL_PREFIX.match(text)
    return (m.group(1), m.group(2)) if m else None
