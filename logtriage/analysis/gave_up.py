"""A worker that said why it gave up: its own line, before the launcher reported its exit code, that ends on
the word that it gives up, after a reason (`rank 2: shard part-002.npz has 0 rows after the label filter;
aborting`), or that says what it aborted and then why (`sys.exit("meadow survey aborted, no readings left")`).
The exit code is then no failure without a message: the program ended itself on purpose, and its line says
why. A rank its peers lost with no launcher line of its exit is read the same way, from its last lines before
the first lost connection."""

from __future__ import annotations

import re
from dataclasses import replace

from logtriage.analysis.findings import Finding
from logtriage.analysis.hangs import fallback_rule
from logtriage.analysis.last_lines import pieces_before
from logtriage.analysis.live_errors import EXIT_RULE
from logtriage.analysis.rank_evidence import PEER_LEFT_RULES
from logtriage.analysis.roots import RootCause
from logtriage.analysis.stopped import line_finding
from logtriage.catalog.loader import Catalog
from logtriage.catalog.rule import Category
from logtriage.demux.streams import StreamKey, StreamKind
from logtriage.scan_result import ScanResult

LOGGED_RULE = "python.logged_error"
# the line ends on the word that it gives up, after a reason (`...; aborting`, `..., giving up`,
# `... failed its checksum at step 3 (...); exiting`); a word that goes on (`exiting 124 for requeue`,
# `aborting, scratch volume has ...`) is another kind of line
_GIVES_UP = re.compile(r"\w.*?\S(?:[;,:]| -+| ?[–—]) *(?:aborting|giving up|gave up|bailing out|exiting|stopping|"
                       r"quitting|terminating)(?: (?:now|the run|the job|training|the solver|solver|run|job))?[.!]*$",
                       re.IGNORECASE)
# or it says what it aborted, then why (`rank 3: meadow survey aborted, no readings left in shard at step 3`,
# `fleece grading aborted on rank 0: shearing record for lot VL-011 is missing`: `sys.exit(message)`'s words)
_ABORTED = re.compile(r"^\W*(?:\w[\w.-]*\W+){0,6}?(?:aborted|abandoned|halted)(?: (?:on|for|at) rank \d+)? ?[:;,–—] *"
                      r"\w+(?:\W+\w+){2,}", re.IGNORECASE)
# a reason's own words, beyond the rank's label (`rank 2: ...`, `[rank 3] ...`)
_RANK_LABEL = re.compile(r"^\W*(?:rank|worker|proc(?:ess)?)\W*\d+\W*", re.IGNORECASE)
_MIN_REASON_WORDS = 3
_WORKER_KINDS = frozenset({StreamKind.RANK, StreamKind.UNATTRIBUTED})


def gave_up_before_exit(scan: ScanResult, keys: list[StreamKey], root: RootCause, catalog: Catalog) -> RootCause:
    """An exit-code root whose rank said, in the lines before its exit, that it gives up and why: the root
    is that line, the program's own error message."""
    f = root.finding
    if root.rule.id != EXIT_RULE or root.rank is None or f is None:
        return root
    return _said_why(scan, keys, root, f.source, f.line, catalog,
                     "the program ended itself on that error, and the exit code only confirms it")


def gave_up_before_its_peers(scan: ScanResult, keys: list[StreamKey], root: RootCause, findings: list[Finding],
                             catalog: Catalog) -> RootCause:
    """A rank read as the one that left without a word (its peers lost their connections to it, no launcher
    line holds its exit) whose last line before the first of those lost connections says it gives up and why."""
    if root.rule.id != EXIT_RULE or root.rank is None or root.finding is not None:
        return root
    lost = [f for f in findings if f.is_error and f.rank is not None and f.rank != root.rank
            and f.rule.id in PEER_LEFT_RULES and f.block_id in scan.blocks]
    if not lost:
        return root
    first = min(lost, key=lambda f: (f.source, scan.blocks[f.block_id][1]))
    # (the reading it replaces said the rank left without a message: it left one)
    root = replace(root, reasons=(f"every error found is another rank's peer connection closing "
                                  f"({first.rule.id}): rank {root.rank} left first",))
    return _said_why(scan, keys, root, first.source, scan.blocks[first.block_id][1], catalog,
                     "the program ended itself on that error, and its peers then lost their connections to it")


def _said_why(scan: ScanResult, keys: list[StreamKey], root: RootCause, source: int, end: int, catalog: Catalog,
              then: str) -> RootCause:
    # (its last such line, not only its last line: a rank's stdout, buffered, is flushed after the stderr it
    # gave up on when it exits, `--tee`'s `rank 3 step 0 ...` after `rank 3: edge batch 1 has ...; aborting`)
    last = None
    for number, stream, rank, piece in pieces_before(scan, keys, source, end):
        piece = piece.strip()
        if (rank == root.rank or (rank is None and _names_rank(piece, root.rank))) and stream.kind in _WORKER_KINDS \
                and (_GIVES_UP.match(piece) or _ABORTED.match(piece)) \
                and len(_RANK_LABEL.sub("", piece).split()) >= _MIN_REASON_WORDS + 1:
            last = (number, piece)
    if last is None:
        return root
    rule = catalog.get(LOGGED_RULE) or fallback_rule(
        LOGGED_RULE, Category.PYTHON_EXCEPTION, "The script logged an error and exited")
    finding = replace(line_finding(scan, keys, rule, (source, last[0], last[1])), rank=root.rank)
    return replace(root, rule=rule, finding=finding, confidence=max(root.confidence, 0.5), reasons=root.reasons + (
        f"rank {root.rank}'s line before its exit (line {last[0]}) says why it gave up: {then}",))


def _names_rank(piece: str, rank: int) -> bool:
    """Whether a line no stream claims names the rank in its words (`hoodoo rank 0: caprock table ...`,
    `... aborted on rank 0: ...`), where no rank marker at its head says whose it is."""
    return re.search(rf"\brank\s*{rank}\b", piece, re.IGNORECASE) is not None
