"""Python's faulthandler dumps that were reports, not a watchdog's exit: `faulthandler.dump_traceback_later(t)`
(its default `exit=False`) prints `Timeout (0:00:05)!` and every thread's stack, then the process goes on. Where
the ranks then time out in their collective, the dumps did not end the run: the timeouts are the failure, and the
stacks say where each rank was when the dump fired, the stalled rank in its own code and the others in the
collective that waited for it. (With `exit=True` the dumping rank exits at once and its peers only lose their
connection: hang.watchdog_heartbeat's reading stands.)"""

from __future__ import annotations

import re
from dataclasses import replace

from logtriage.analysis.findings import Finding
from logtriage.analysis.interrupted_work import LIBRARY_FILE
from logtriage.analysis.roots import RankFacts, RootCause
from logtriage.analysis.stalls import WATCHDOG_RULE
from logtriage.analysis.timeouts import missing_rank_root
from logtriage.catalog.rule import Category
from logtriage.demux.frames import TORCH_FILE
from logtriage.ingest.lines import read_lines
from logtriage.scan_result import ScanResult

# a frame of faulthandler's dump: `File "/job/train.py", line 222 in main` (no comma before `in`)
_DUMP_FRAME = re.compile(r'File "([^"\n]+)", line (\d+) in (\S+)')
_DUMP_SPAN = 4   # the lines after `Timeout (...)!` to look in for the innermost frame (`Thread 0x...` comes first)


def dumps_then_timeouts(scan: ScanResult, root: RootCause, findings: list[Finding], facts: RankFacts) -> RootCause:
    """A faulthandler timeout dump read as the root, followed by collective timeouts: the timeouts' reading, with
    the rank whose dump alone shows it in its own code (not torch's) where the dumps tie to ranks."""
    f = root.finding
    if root.rule.id != WATCHDOG_RULE or f is None or "timeout" not in f.captures:
        return root
    live = [w for w in findings if w.is_error and not w.is_teardown]
    timeouts = [w for w in live if w.category is Category.COLLECTIVE_TIMEOUT and w.seq > f.seq and w.rank is not None]
    if not timeouts:
        return root
    reading = missing_rank_root(timeouts, live, facts, findings)
    dumps = [w for w in findings if w.rule.id == WATCHDOG_RULE and "timeout" in w.captures]
    note = (f"faulthandler's `Timeout ({f.captures['timeout']})!` dumps were reports, not an exit: the ranks went "
            "on and timed out in their collective afterwards, so the timeouts end the run",)
    own = _own_code_dump(scan, dumps)
    if own is None:
        return replace(reading, reasons=note + reading.reasons)
    rank, frame = own
    dump = next(w for w in dumps if w.rank == rank)
    return replace(reading, rank=rank, ranks=(rank,), confidence=max(reading.confidence, 0.55), reasons=note + (
        f"rank {rank}'s dump shows it in its own code (`{frame}`) while every other dump is inside torch (the "
        f"collective it waited in): rank {rank} stalled there (line {dump.line}), and the others waited for it",))


def _own_code_dump(scan: ScanResult, dumps: list[Finding]) -> tuple[int, str] | None:
    """(rank, `function` at file:line) of the one rank-tied dump whose innermost frame is the program's own, when
    every other rank-tied dump's is torch's (a dump of a library's thread, a DataLoader's or a logger's, tells
    nothing)."""
    own, torch, library = [], 0, 0
    for dump in dumps:
        if dump.rank is None or dump.source >= len(scan.sources):
            continue
        numbers = list(range(dump.line + 1, dump.line + 1 + _DUMP_SPAN))
        texts = read_lines(scan.sources[dump.source], scan.indexes[dump.source], numbers)
        frame = next((m for n in numbers if (m := _DUMP_FRAME.search(texts.get(n, "")))), None)
        if frame is None:
            continue
        if TORCH_FILE.search(frame.group(1)):
            torch += 1
        elif LIBRARY_FILE.search(frame.group(1)):
            library += 1
        else:
            own.append((dump.rank, f"{frame.group(3)} at {frame.group(1).rsplit('/', 1)[-1]}:{frame.group(2)}"))
    ranks = {rank for rank, _ in own}
    return own[0] if len(ranks) == 1 and not library and (torch or len(own) == 1) else None
