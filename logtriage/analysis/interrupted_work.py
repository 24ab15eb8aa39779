"""A job stopped from outside whose tracebacks say where each rank was when the stop came.

A signal handler that runs Python code prints, when it fails, a traceback whose frame just before the handler's
own frame is where the process was interrupted. Lightning's SIGTERM handler (`signal_connector.py`,
`_sigterm_notifier_fn`) broadcasts the stop to the other ranks; a `timeout` that ends a hung Lightning job makes
it fail on every rank, and each rank's traceback then shows both: the ranks that waited were inside a collective
(`torch/distributed/...`, a `wait`), the one that held them up was in its own code (`felt = (felt * 31 + i) ...`
in `step_body`). Where at least one rank waited in a collective and exactly one was at work, the stop ended a hang
that rank caused: the report is hang.stopped_while_waiting on that rank, not the stop. A healthy job's handlers
all reach their broadcast and print nothing, so these tracebacks are themselves the sign that the ranks were not in
step. (A Ctrl-C's KeyboardInterrupt tracebacks are not read this way: in a healthy run stopped by hand, one rank
computing while the others wait in a collective is only the moment the key was pressed.)
"""

from __future__ import annotations

import re
from dataclasses import replace

from logtriage.analysis.findings import Finding
from logtriage.analysis.lost_peers import lost_a_peer
from logtriage.analysis.refine import WAITING_FRAMES, stopped_while_waiting_rule
from logtriage.analysis.roots import RootCause
from logtriage.analysis.stream_lines import stream_messages
from logtriage.catalog.loader import Catalog
from logtriage.catalog.rule import Category
from logtriage.demux.frames import FRAME
from logtriage.demux.streams import StreamKey, StreamKind
from logtriage.scan_result import ScanResult

MAX_BLOCK_LINES = 400   # a traceback longer than this is read no further (its frames are not this shape)
MAX_BLOCKS = 1024       # tracebacks read back at most (the reading is per line)
# a signal handler's frame: Lightning's connector, torchelastic's, a program's own `handler(signum, frame)`
# (`signal_handler`, `_sigterm_handler`, `handle_sigterm`, `_sigterm_notifier_fn`; not any `*_handler`)
_HANDLER = re.compile(r"signal_connector\.py$|^_?(?:signal|sig(?:term|int|usr\d)?)_?handler$|^_?sig(?:term|int)_\w+$|"
                      r"^_?handle_?sig\w*$|^_?terminate_process_handler$", re.IGNORECASE)
# library code: an installed package or the standard library
LIBRARY_FILE = re.compile(r"/(?:site|dist)-packages/|/lib/python\d[\d.]*/|^<frozen ")
_COLLECTIVE_FILE = re.compile(r"/torch/distributed/")


def stopped_mid_work(scan: ScanResult, keys: list[StreamKey], root: RootCause, catalog: Catalog) -> RootCause:
    """An external stop whose interrupted tracebacks put every rank but one in a collective wait and that one in
    its own work: the hang that rank caused, which the stop ended."""
    if root.rule.category is not Category.EXTERNAL_STOP:
        return root
    places = _interrupted_places(scan, keys, root.finding)
    waiting = sorted(rank for rank, (kind, _) in places.items() if kind == "waiting")
    working = sorted(rank for rank, (kind, _) in places.items() if kind == "working")
    if not waiting or len(working) != 1:
        return root
    rank = working[0]
    where = places[rank][1]
    listed = ", ".join(str(r) for r in waiting)
    return replace(root, rule=stopped_while_waiting_rule(catalog), rank=rank, ranks=(rank,),
                   confidence=min(root.confidence, 0.5), reasons=root.reasons + (
                       f"the stop interrupted rank {rank} in its own code ({where}) while rank"
                       f"{'s' if len(waiting) > 1 else ''} {listed} waited inside a collective: the job hung "
                       f"where rank {rank} kept the others waiting, and the stop ended that hang",))


def waits_the_stop_ended(root: RootCause, findings: list[Finding], known: frozenset[int],
                         catalog: Catalog) -> RootCause:
    """An external stop after which every rank but one reports its collective wait ended in a timeout, and that one
    only lost its peers (their connections closed as they died): the waiting ranks were inside the collective when
    the stop came (a 300 s process-group timeout reported at a stop a minute into the run), the other had not
    reached it. The stop ended a hang that rank caused (cpu_adhoc 579th batch: Lightning's SIGTERM handler lets
    each rank's wait end with an error). A healthy job stopped from outside is in step: no rank's wait is left."""
    if root.rule.category is not Category.EXTERNAL_STOP or root.finding is None:
        return root
    stop = root.finding
    after = [f for f in findings if f.is_error and not f.is_teardown and f.rank is not None
             and f.source == stop.source and f.line > stop.line]
    waited = {f.rank for f in after if f.category is Category.COLLECTIVE_TIMEOUT}
    lost = {f.rank for f in after if lost_a_peer(f)}
    others = {f.rank for f in after} - waited - lost
    if not waited or len(lost - waited) != 1 or others or waited | lost != set(known) or len(known) < 2:
        return root
    rank = next(iter(lost - waited))
    listed = ", ".join(str(r) for r in sorted(waited))
    return replace(root, rule=stopped_while_waiting_rule(catalog), rank=rank, ranks=(rank,),
                   confidence=min(root.confidence, 0.45), reasons=root.reasons + (
                       f"after the stop, rank{'s' if len(waited) > 1 else ''} {listed} reported a collective wait "
                       f"that ended in a timeout (they were inside it when the stop came) and rank {rank} only lost "
                       "its peers as they died: it had not reached the collective, the others had hung waiting for "
                       "it, and the stop ended that hang",))


def _interrupted_places(scan: ScanResult, keys: list[StreamKey], stop: Finding | None) -> dict[int, tuple[str, str]]:
    """{rank: ("waiting" or "working", the interrupted frame)} from the tracebacks a stop left (none before the
    stop's own line in its input)."""
    places: dict[int, tuple[str, str]] = {}
    read = 0
    for block_id, (source, first, last) in sorted(scan.blocks.items()):
        slot = scan.block_slots.get(block_id)
        if scan.block_kinds.get(block_id) != "traceback" or slot is None or last - first > MAX_BLOCK_LINES \
                or (stop is not None and source == stop.source and first < stop.line):
            continue
        stream = keys[scan.slots.final(slot)]
        if stream.kind is not StreamKind.RANK or stream.rank in places:
            continue
        if read >= MAX_BLOCKS:
            break
        read += 1
        place = _handler_caller(_frames(scan, keys, stream, source, first, last))
        if place is not None:
            places[stream.rank] = place
    return places


def _frames(scan: ScanResult, keys: list[StreamKey], stream: StreamKey, source: int, first: int,
            last: int) -> list[tuple[str, str]]:
    """(file, function) of each frame of the stream's traceback on those lines."""
    frames = [FRAME.match(text) for _, text in stream_messages(scan, keys, stream, source, first, last)]
    return [(m.group(2), m.group(3)) for m in frames if m]


def _handler_caller(frames: list[tuple[str, str]]) -> tuple[str, str] | None:
    """The place (kind, `func` in file) of the frame just before the first signal handler's frame."""
    for i, (file, func) in enumerate(frames):
        if i and (_HANDLER.search(file) or _HANDLER.search(func)):
            return _place(*frames[i - 1])
    return None


def _place(file: str, func: str) -> tuple[str, str]:
    name = file.rsplit("/", 1)[-1]
    if func in WAITING_FRAMES or _COLLECTIVE_FILE.search(file):
        return "waiting", f"`{func}` in {name}"
    if LIBRARY_FILE.search(file):
        return "library", f"`{func}` in {name}"
    return "working", f"`{func}` in {name}"
