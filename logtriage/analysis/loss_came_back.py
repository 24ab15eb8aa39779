"""A NaN or inf loss that the same rank's next progress lines show finite again: the run went on from it.

`rank 0 step 0 loss nan`, then `rank 0 step 1 loss 3.8923` from the same rank: a first step's loss a callback read
before any was computed, a batch a guard skipped, a loss-scale overflow the scaler undid. Such a printed loss is no
error of the run (a control run of the cpu_adhoc 558th batch, a `transformers.Trainer` under torchrun, exited 0
after exactly this). Only a progress line of a later step counts: a rank's buffered stdout, printed after the error (torchrun's
`--tee`), holds the steps before it. A loss that stays NaN (no finite loss at a later step from that rank within
`WINDOW` lines) stays the error, and so does one a traceback raised. A rank stopped before its next progress line
(killed) whose NaN loss every other rank printed at the same step and went on from printed the same placeholder.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING

from logtriage.analysis.stream_lines import stream_messages
from logtriage.demux.streams import StreamKey
from logtriage.scan_result import ScanResult, step_number

if TYPE_CHECKING:
    from logtriage.analysis.findings import Finding

LOSS_NAN_RULE = "numerical.loss_nan"
WINDOW = 200          # lines after a NaN loss searched for the same rank's finite one
MAX_READS = 3         # NaN losses per rank whose following lines are read (a diverged run prints thousands)
# a progress line's loss as a plain number (`loss 3.8766632080078125`, `loss: 0.25`, `loss=1.2e-03`)
_FINITE_LOSS = re.compile(r"\bloss\s*[:=]?\s*[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w.])", re.IGNORECASE)
_NOT_FINITE = re.compile(r"\b(?:nan|inf(?:inity)?)\b", re.IGNORECASE)


def mark_loss_came_back(findings: list["Finding"], scan: ScanResult, keys: list[StreamKey]) -> list["Finding"]:
    """The findings, each printed NaN/inf loss that its rank's own later progress line shows finite marked as
    gone on from."""
    printed = [f for f in findings if f.rule.id == LOSS_NAN_RULE and f.captures.get("value") and f.rank is not None
               and f.source < len(scan.sources) and not f.block_exception and step_number(f.text) is not None]
    if not printed:
        return findings
    back: set[tuple[int, int]] = set()
    for stream in {f.stream for f in printed}:
        ours = sorted((f for f in printed if f.stream == stream), key=lambda f: (f.source, f.line))
        back |= _came_back(ours, scan, keys, stream)
    back |= _alike_on_the_others(printed, back)
    return [replace(f, went_on=True) if (f.source, f.line) in back and f.rule.id == LOSS_NAN_RULE else f
            for f in findings]


def _came_back(ours: list["Finding"], scan: ScanResult, keys: list[StreamKey], stream: StreamKey) -> set[tuple[int, int]]:
    """(source, line) of the stream's NaN losses that a finite loss of its own follows."""
    back: set[tuple[int, int]] = set()
    finite_at: tuple[int, int] | None = None   # the finite loss found last: every NaN before it came back
    reads = 0
    for finding in ours:
        here = (finding.source, finding.line)
        if finite_at is not None and finite_at[0] == here[0] and here[1] < finite_at[1]:
            back.add(here)
            continue
        if reads >= MAX_READS:
            break
        reads += 1
        line = _finite_loss_after(finding, scan, keys, stream)
        if line is not None:
            finite_at = (finding.source, line)
            back.add(here)
    return back


def _alike_on_the_others(printed: list["Finding"], back: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """(source, line) of NaN losses a rank printed at a step where every other rank that printed one went on from it
    (two at least): the same placeholder everywhere (a Trainer callback's first loss), on a rank stopped before its
    next progress line (killed, or failing for another reason); not where that rank printed a NaN loss later on."""
    at_step: dict[int, list["Finding"]] = {}
    last_step: dict[int, int] = {}   # each rank's last step with a NaN loss
    for f in printed:
        step = step_number(f.text)
        at_step.setdefault(step, []).append(f)
        last_step[f.rank] = max(last_step.get(f.rank, step), step)
    alike: set[tuple[int, int]] = set()
    for step, printed_then in at_step.items():
        went_on = {f.rank for f in printed_then if (f.source, f.line) in back}
        stayed = [f for f in printed_then if (f.source, f.line) not in back]
        if len(went_on) >= 2 and not any(f.rank in went_on for f in stayed):
            alike |= {(f.source, f.line) for f in stayed if last_step[f.rank] == step}
    return alike


def _finite_loss_after(finding: "Finding", scan: ScanResult, keys: list[StreamKey], stream: StreamKey) -> int | None:
    step = step_number(finding.text)
    for number, text in stream_messages(scan, keys, stream, finding.source, finding.line + 1, finding.line + WINDOW):
        later = step_number(text)
        if later is None or step is None or later <= step:
            continue   # (a buffered stdout printed after the error holds the earlier steps: no sign)
        if _FINITE_LOSS.search(text) and not _NOT_FINITE.search(text):
            return number
    return None
