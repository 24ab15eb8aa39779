"""The time of a traceback that carries none: Python's `logger.exception(...)` (and loguru's, and a
handler that formats its own records) writes one stamped record line, `2026-12-03T11:19:08.405 rank1
ERROR step 3: batch failed`, and the traceback under it, unstamped. The record's time is the
traceback's, when that line is the one right before the traceback, in the same stream, and at an
error level."""

from __future__ import annotations

import re

from logtriage.analysis.timestamps import Stamp, parse_stamp
from logtriage.demux.prefixes import Dialect, strip_prefixes
from logtriage.ingest.lines import read_lines
from logtriage.scan_result import Hit, ScanResult

_ERROR_LEVEL = re.compile(r"\b(?:ERROR|CRITICAL|FATAL|EXCEPTION)\b")
_TASK_LABEL = re.compile(r"^[\w.-]{1,40}: ")
MAX_BLOCKS = 2000    # tracebacks looked at; a log with more keeps their lines' own (missing) times


def record_stamps(scan: ScanResult, hits: list[Hit]) -> dict[int, Stamp]:
    """block id -> the time of the error record right before that traceback, for the tracebacks
    among `hits` whose lines carry no time of their own."""
    wanted: dict[int, dict[int, int]] = {}     # source -> {record line: block id}
    count = 0
    for hit in hits:
        if hit.stamp is not None or hit.block_id < 0 or scan.block_kinds.get(hit.block_id) != "traceback":
            continue
        source, first, _ = scan.blocks.get(hit.block_id, (hit.source, 0, 0))
        index = scan.indexes[source]
        if first < 2 or first - 1 > len(index.slots) or count >= MAX_BLOCKS:
            continue
        if scan.slots.final(index.slots[first - 2]) != scan.slots.final(hit.slot):
            continue     # the line before is another stream's
        records = wanted.setdefault(source, {})
        count += (first - 1) not in records
        records[first - 1] = hit.block_id
    stamps: dict[int, Stamp] = {}
    for source, records in wanted.items():
        texts = read_lines(scan.sources[source], scan.indexes[source], list(records))
        for number, text in texts.items():
            stamp = stamp_of_line(text)
            if stamp is not None and _ERROR_LEVEL.search(text[:200]):
                stamps[records[number]] = stamp
    return stamps


def stamp_of_line(text: str) -> Stamp | None:
    """The time a line read back from the input starts with, behind its launcher's labels (also a
    task's or host's label the default dialect leaves on it: srun's `1: `, pdsh's `worker-0: `)."""
    message = strip_prefixes(text, Dialect()).text.strip()
    return parse_stamp(message) or parse_stamp(_TASK_LABEL.sub("", message, count=1))
