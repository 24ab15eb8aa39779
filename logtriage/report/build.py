"""Turn a diagnosis into the report model: evidence lines read back from the inputs, findings
collapsed per rule and rank, identical per-rank lines counted once."""

from __future__ import annotations

import re
from typing import Callable

from logtriage.analysis.diagnose import Diagnosis
from logtriage.analysis.exception_names import exception_type_of
from logtriage.analysis.findings import Finding
from logtriage.analysis.roots import RootCause
from logtriage.demux.streams import StreamKind
from logtriage.ingest.lines import read_lines
from logtriage.report.model import (ChainEntry, EvidenceLine, FindingView, RankRow, Report, RootCauseView,
                                    StreamRow)
from logtriage.scan_result import ScanResult

MAX_FINDINGS = 400
EVIDENCE_BEFORE = 3
EVIDENCE_AFTER = 3
MAX_BLOCK_EVIDENCE = 30


def build_report(scan: ScanResult, diag: Diagnosis, redact: Callable[[str], str] = lambda s: s,
                 redaction: dict | None = None) -> Report:
    names = [s.name for s in scan.sources]
    root_view = _root_view(scan, diag, diag.root, names, redact)
    recovered_view = _root_view(scan, diag, diag.recovered, names, redact)
    chain = tuple(ChainEntry(link.rule.id, link.rule.category.value, link.rule.title, link.role.value, link.ranks,
                             link.first.line, names[link.first.source], redact(link.first.text), link.count)
                  for link in diag.chain)
    ranks = tuple(
        RankRow(s.key.rank, s.key.attempt, s.key.host, s.lines, s.status, s.role,
                s.first_error.line if s.first_error else None,
                names[s.first_error.source] if s.first_error else None,
                redact(s.first_error.text) if s.first_error else None,
                s.last_step, s.last_step_line[1] if s.last_step_line else None)
        for s in diag.streams if s.key.kind is StreamKind.RANK)
    streams = tuple(StreamRow(s.key.label(), s.key.kind.value, s.key.rank_or_none, s.key.attempt, s.lines)
                    for s in diag.streams if s.lines)
    unattributed = sum(s.lines for s in diag.streams if s.key.kind is StreamKind.UNATTRIBUTED)
    return Report(
        verdict=diag.verdict.value, root_cause=root_view, recovered=recovered_view, chain=chain, ranks=ranks,
        findings=_findings(diag.findings, names, redact), environment=diag.environment.to_dict(),
        input_lines=scan.input_lines, unattributed_lines=unattributed, streams=streams,
        sources=tuple(names), notes=diag.notes + tuple(diag.environment.problems),
        problems=tuple(scan.problems), redaction=redaction or {})


NEARBY_LINES = 200
# a script's logged error (`ERROR ...: rank 4 ...` then `sys.exit(4)`) has a traceback only when logger.exception
# wrote one, on the lines right after it; a traceback further on is another error's (a restarted attempt's failure
# to connect, cpu_adhoc 500th batch's mead_logged_exit_np5_r4_restart)
LOGGED_ERROR_RULE = "python.logged_error"
LOGGED_TRACEBACK_LINES = 3
# the C++ runtime's words for an exception nothing caught (`terminate called after throwing an instance of
# 'gloo::EnforceNotMet'`), and its message on the next line (`  what():  [enforce fail at ...`)
_THROWN = re.compile(r"terminate called after throwing an instance of '([\w:<>, ]+)'")
_WHAT = re.compile(r"^\W{0,3}\s*what\(\): ")


def _root_view(scan: ScanResult, diag: Diagnosis, root: RootCause | None, names: list[str],
               redact: Callable[[str], str]) -> RootCauseView | None:
    if root is None:
        return None
    f = root.finding
    evidence = _evidence(scan, diag, f, redact) if f is not None else ()
    if f is None and root.rank is not None:
        evidence = _progress_evidence(scan, diag, root.ranks, redact)
    return RootCauseView(
        rule_id=root.rule.id, category=root.rule.category.value, title=root.rule.title, rank=root.rank,
        ranks=root.ranks, line=f.line if f else None, source=names[f.source] if f else None,
        text=redact(f.text) if f else "", exception_type=_exception_type(scan, diag, f) if f else None,
        confidence=root.confidence, layer=root.rule.layer.value if root.rule.layer else None,
        explanation=root.rule.explanation, fix=root.rule.fix, misdiagnosis=root.rule.misdiagnosis,
        reasons=tuple(redact(r) for r in root.reasons), evidence=evidence,
        stream=f.stream.label() if f else None)


def _exception_type(scan: ScanResult, diag: Diagnosis, finding: Finding) -> str | None:
    """The exception the root line belongs to: its own, C++'s type on the line above its `what():`, its
    traceback's, the same error's soon after,
    or the first traceback of the same stream that starts soon after it (a device-side assert printed before the
    `RuntimeError: CUDA error` traceback)."""
    if finding.exception_type:
        return finding.exception_type
    thrown = _THROWN.search(finding.text)
    if thrown:
        # the C++ runtime's `terminate called after throwing an instance of 'std::out_of_range'`: the type it names
        return thrown.group(1)
    if _WHAT.search(finding.text) and 0 <= finding.source < len(scan.sources):
        # C++'s `what():` line of an uncaught exception: its type is on the line above it
        above = read_lines(scan.sources[finding.source], scan.indexes[finding.source], [finding.line - 1])
        thrown = _THROWN.search(above.get(finding.line - 1, ""))
        if thrown:
            return thrown.group(1)
    stream = finding.stream
    # the same error again soon after, as an exception line (spliced pastes; an unprefixed C++ warning
    # of torchrun's store, then the agent's own traceback ending in that error; an unprefixed NCCL
    # WARN, then a rank's DistBackendError quoting it); or on another rank, when the root line is
    # one rank's message without its exception line (an excerpt that starts inside it)
    for other in diag.findings:
        # its own stream, or (for a rank's or an unattributed line) any rank's or the launcher's
        may_tell = other.stream == stream or (stream.kind in (StreamKind.UNATTRIBUTED, StreamKind.RANK)
                                              and other.stream.kind in (StreamKind.LAUNCHER, StreamKind.RANK))
        if (other.rule.id == finding.rule.id and may_tell and other.exception_type
                and other.source == finding.source and finding.line < other.line <= finding.line + NEARBY_LINES):
            return other.exception_type
    if stream.kind is StreamKind.LAUNCHER:
        # a launcher line about a worker: the launcher's own traceback is not its cause (unless it
        # is the same error, above: torchrun's `Received 15 death signal` and its SignalException)
        return None
    nearby = LOGGED_TRACEBACK_LINES if finding.rule.id == LOGGED_ERROR_RULE else NEARBY_LINES
    for block_id, (source, first, _) in sorted(scan.blocks.items(), key=lambda kv: kv[1][1]):
        if source != finding.source or not finding.line <= first <= finding.line + nearby:
            continue
        exception = scan.block_exceptions.get(block_id)
        slot = scan.block_slots.get(block_id)
        if exception and slot is not None and diag.keys[scan.slots.final(slot)] == stream:
            found = exception_type_of(exception)
            if found:
                return found
    return None


def _findings(findings: tuple[Finding, ...], names: list[str], redact) -> tuple[FindingView, ...]:
    grouped: dict[tuple, list[Finding]] = {}
    for f in findings:
        grouped.setdefault((f.rule.id, f.rank, f.stream.attempt, f.rank is None and f.stream.label()), []).append(f)
    out = []
    for group in sorted(grouped.values(), key=lambda g: g[0].seq)[:MAX_FINDINGS]:
        f = group[0]
        out.append(FindingView(f.rule.id, f.category.value, f.role.value, f.rank, f.line, names[f.source],
                               redact(f.text), {k: redact(v) for k, v in f.captures.items()}, f.stream.label(),
                               len(group)))
    return tuple(out)


def _evidence(scan: ScanResult, diag: Diagnosis, finding: Finding, redact) -> tuple[EvidenceLine, ...]:
    """The root line with its block (a whole traceback) or a few lines of its stream around it."""
    source = finding.source
    index = scan.indexes[source]
    target = diag.keys[scan.slots.final(index.slots[finding.line - 1])] if finding.line <= len(index.slots) else None
    block = scan.blocks.get(finding.block_id) if finding.block_id >= 0 else None
    wanted: list[int] = []
    if block is not None and block[0] == source:
        first, last = block[1], block[2]
        first = max(first, last - MAX_BLOCK_EVIDENCE + 1, 1)
        wanted = [n for n in range(first, last + 1) if _same(scan, diag, source, n, target)]
    else:
        before = _walk(scan, diag, source, finding.line, -1, EVIDENCE_BEFORE, target)
        after = _walk(scan, diag, source, finding.line, +1, EVIDENCE_AFTER, target)
        wanted = sorted(before + [finding.line] + after)
    if finding.line not in wanted:
        wanted = sorted(set(wanted) | {finding.line})
    texts = read_lines(scan.sources[source], index, wanted)
    name = scan.sources[source].name
    return tuple(EvidenceLine(name, n, redact(texts.get(n, "")), n == finding.line) for n in wanted)


def _progress_evidence(scan: ScanResult, diag: Diagnosis, ranks, redact) -> tuple[EvidenceLine, ...]:
    out = []
    for s in diag.streams:
        if s.key.kind is StreamKind.RANK and s.key.rank in ranks and s.last_step_line:
            src, line = s.last_step_line
            text = read_lines(scan.sources[src], scan.indexes[src], [line]).get(line, "")
            out.append(EvidenceLine(scan.sources[src].name, line, redact(text), True))
    return tuple(out)


def _same(scan: ScanResult, diag: Diagnosis, source: int, number: int, target) -> bool:
    slots = scan.indexes[source].slots
    return 0 < number <= len(slots) and diag.keys[scan.slots.final(slots[number - 1])] == target


def _walk(scan, diag, source, start, step, count, target) -> list[int]:
    found, number, budget = [], start + step, 400
    total = len(scan.indexes[source].slots)
    while 0 < number <= total and len(found) < count and budget:
        if _same(scan, diag, source, number, target):
            found.append(number)
        number += step
        budget -= 1
    return found
