"""The fast scan: read big chunks, classify their lines in compiled code and prefilter them with
one RE2 pass (in worker processes, one per core), then merge in input order (merge.py) while
the workers analyse the next chunks."""

from __future__ import annotations

import itertools
import os
import signal
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Callable

import numpy as np

from logtriage.catalog.matcher import Matcher
from logtriage.demux.clean import clean, decode
from logtriage.demux.prefixes import Dialect
from logtriage.errors import InputError
from logtriage.fastscan.chunks import file_chunks, stream_chunks
from logtriage.fastscan.flags import CANDIDATE, COLLECTOR_STAMP, NOT_PLAIN, SRUN_LABEL
from logtriage.fastscan.merge import ChunkLines, ChunkMerger
from logtriage.ingest.sources import Source, needs_stream
from logtriage.scan import DIALECT_SAMPLE, LineScanner
from logtriage.scan_result import ScanResult, SourceIndex, new_result

CHUNK_BYTES = 16 << 20
RANGE_TAIL = 64 << 10    # read past a range's end to finish its last line
IN_FLIGHT = 3            # chunks analysed ahead of the merge (file buffers in the ring: IN_FLIGHT + 1)
_PREFILTER = None


def fast_scan(sources: tuple[Source, ...], matcher: Matcher, progress: Callable[[int], None] | None = None,
              workers: int | None = None) -> ScanResult:
    from logtriage.fastscan.prefilter import prefilter_for
    result = new_result(sources)
    prefilter = prefilter_for(matcher.rules)
    pool = _pool(workers, prefilter)
    finished = False
    try:
        for source in sources:
            index = SourceIndex()
            result.indexes.append(index)
            try:
                _scan_source(result, source, index, matcher, prefilter, pool, progress)
            except InputError as exc:
                result.problems.append(str(exc))
                result.unreadable.append(str(exc))
        finished = True
    finally:
        if pool is not None:
            if finished:
                pool.shutdown(wait=True, cancel_futures=True)
            else:
                _stop_workers(pool)
    return result


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Interrupted (Ctrl-C) or failed: kill the workers instead of waiting for them. A
    KeyboardInterrupt can land inside the executor's own bookkeeping (while it starts a worker,
    while it reads a result), and waiting on a pool left in that state never ends: the CLI then
    leaves without the interpreter's wait for the pool's threads (cli.entry). A write the pool's
    feeder thread still makes to a dead worker fails quietly instead of killing the process."""
    try:
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    except (ValueError, AttributeError):   # not the main thread (the TUI scans in a worker thread)
        pass
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        try:
            process.kill()
        except (OSError, ValueError, AttributeError):
            pass


def _scan_source(result, source, index, matcher, prefilter, pool, progress) -> None:
    path = None if source.is_stdin or _is_stream(source) else str(source.path)
    if path is not None:
        with open(path, "rb") as f:
            head_bytes = f.read(1 << 20)
    else:
        chunks = stream_chunks(source, index, CHUNK_BYTES)
        first = next(chunks, None)
        head_bytes = b"" if first is None else bytes(first[1][: 1 << 20])
    head = head_bytes.split(b"\n", DIALECT_SAMPLE)[:DIALECT_SAMPLE] if head_bytes else []
    scanner = LineScanner(result, source, index, matcher, Dialect.detect(clean(decode(raw)) for raw in head))
    dialect = scanner.assigner.dialect
    labels = (SRUN_LABEL if dialect.srun and not dialect.srun_nodes else 0) | (COLLECTOR_STAMP if dialect.stamped else 0)
    # prefixes the kernel does not parse (an indented paste it hands back line by line: a line that
    # starts with a blank is never plain)
    if dialect.exact_only:
        _exact(scanner, file_chunks(source, CHUNK_BYTES, IN_FLIGHT) if path is not None else itertools.chain([first] if first else [], chunks))
    elif path is not None:
        _file_ranges(scanner, path, pool, prefilter, progress, labels)
    elif first is not None:
        _stream(scanner, itertools.chain([first], chunks), pool, prefilter, progress, labels)
    scanner.close()


def _file_ranges(scanner: LineScanner, path: str, pool, prefilter, progress, labels: int) -> None:
    """A regular file: workers read and analyse byte ranges themselves (the lines that start in
    each range); this process only reads back the few lines the exact path needs."""
    global _PREFILTER
    _PREFILTER = prefilter
    hint = -1 if scanner.rank_hint is None else scanner.rank_hint
    size = os.path.getsize(path)
    merger = ChunkMerger(scanner)
    number = 1
    pending: deque = deque()
    fd = os.open(path, os.O_RDONLY)
    try:
        for low in range(0, size, CHUNK_BYTES):
            high = min(low + CHUNK_BYTES, size)
            job = (pool.submit(_analyse_range, path, low, high, hint, labels) if pool
                   else _analyse_range(path, low, high, hint, labels))
            pending.append(job)
            if len(pending) >= IN_FLIGHT:
                number = _merge_range(merger, fd, pending.popleft(), number, progress)
        while pending:
            number = _merge_range(merger, fd, pending.popleft(), number, progress)
    finally:
        os.close(fd)


def _merge_range(merger: ChunkMerger, fd: int, job, number: int, progress) -> int:
    start, length, lines = job.result() if isinstance(job, Future) else job
    if length:
        merger.merge(FileSlice(fd, start, length), start, number, lines)
    if progress is not None:
        progress(start + length)
    return number + len(lines.starts)


def _stream(scanner: LineScanner, chunks, pool, prefilter, progress, labels: int) -> None:
    hint = -1 if scanner.rank_hint is None else scanner.rank_hint
    merger = ChunkMerger(scanner)
    number = 1
    pending: deque = deque()
    for base, data in chunks:
        job = (pool.submit(_analyse, bytes(data), hint, labels) if pool is not None
               else _analyse(data, hint, labels, prefilter))
        pending.append((base, data, job))
        if len(pending) >= IN_FLIGHT:
            number = _merge(merger, pending.popleft(), number, progress)
    while pending:
        number = _merge(merger, pending.popleft(), number, progress)


class FileSlice:
    """A chunk of a file read on demand: `data[a:b]` preads just those bytes."""

    def __init__(self, fd: int, base: int, length: int):
        self.fd, self.base, self.length = fd, base, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: slice) -> bytes:
        start, stop, _ = key.indices(self.length)
        return os.pread(self.fd, max(0, stop - start), self.base + start) if stop > start else b""


def _merge(merger: ChunkMerger, pending, number: int, progress) -> int:
    base, data, job = pending
    lines = job.result() if isinstance(job, Future) else job
    merger.merge(data, base, number, lines)
    if progress is not None:
        progress(base + len(data))
    return number + len(lines.starts)


def _exact(scanner: LineScanner, chunks) -> None:
    number = 0
    for base, data in chunks:
        data = bytes(data)
        offset = base
        pieces = data.split(b"\n")
        if data.endswith(b"\n"):
            pieces.pop()
        for raw in pieces:
            number += 1
            scanner.line(number, offset, raw)
            offset += len(raw) + 1


def _analyse(data, rank_hint: int, labels: int = 0, prefilter=None, offset: int = 0,
             size: int | None = None) -> ChunkLines:
    """The per-line arrays of `data[offset:offset + size]` (whole lines), without copying it."""
    from logtriage.fastscan import kernel
    prefilter = prefilter or _PREFILTER
    size = len(data) - offset if size is None else size
    buf = np.frombuffer(data, dtype=np.uint8, count=size, offset=offset)
    n = kernel.count_lines(buf)
    starts = np.empty(n, dtype=np.int64)
    messages = np.empty(n, dtype=np.int32)
    ranks = np.empty(n, dtype=np.int64)
    flags = np.empty(n, dtype=np.uint8)
    cuts = np.empty(n, dtype=np.int32)
    ranks2 = np.empty(n, dtype=np.int64)
    kernel.classify(buf, rank_hint, labels, starts, messages, ranks, flags, cuts, ranks2)
    whole = data if isinstance(data, bytes) else bytes(data)
    candidates = prefilter.candidate_lines(whole, starts, offset, size)
    flags[candidates] |= CANDIDATE
    return ChunkLines(starts, messages, ranks, flags, cuts, ranks2)


def _analyse_range(path: str, low: int, high: int, rank_hint: int, labels: int = 0) -> tuple[int, int, ChunkLines]:
    """The lines whose first byte lies in [low, high): (their start, their length, analysis)."""
    with open(path, "rb") as f:
        fd = f.fileno()
        base = max(low - 1, 0)
        buf = os.pread(fd, high - base + RANGE_TAIL, base)
        if low == 0:
            first = 0
        else:
            nl = buf.find(b"\n")
            first = nl + 1 if 0 <= nl < high - base else -1
        if first < 0:
            return low, 0, _analyse(b"", rank_hint, labels)   # inside one long line that started earlier
        end = buf.find(b"\n", high - 1 - base)
        overlong = end < 0 and len(buf) >= high - base + RANGE_TAIL
        position = len(buf)
        while overlong and end < 0:   # the last line goes on: find its end, keep only what was read
            more = os.pread(fd, RANGE_TAIL << 4, base + position)
            if not more:
                break
            found = more.find(b"\n")
            end = position + found if found >= 0 else -1
            position += len(more)
        stop = end + 1 if end >= 0 else position
        lines = _analyse(buf, rank_hint, labels, offset=first, size=min(stop, len(buf)) - first)
        if overlong and len(lines.flags):
            lines.flags[-1] |= NOT_PLAIN   # analysed in part: the merge reads it back (capped) and matches it
    return base + first, stop - first, lines


def _is_stream(source: Source) -> bool:
    """gzip or UTF-16: read through open_source, not by byte ranges of the file."""
    try:
        return needs_stream(source.path)
    except OSError:
        return False


def _init_worker(prefilter, parent: int) -> None:
    global _PREFILTER
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the parent's to handle
    except OSError:
        pass   # "Signal 2 ignored due to race condition": a Ctrl-C arrived while this was set; it is the parent's
    _die_with_parent(parent)
    _PREFILTER = prefilter


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this worker when the parent ends. A worker the parent was still
    starting when Ctrl-C came is in no list the parent can kill from, and would otherwise wait
    for work forever, holding the terminal's pipes."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)     # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:                     # the parent ended before that took effect
        os._exit(0)


def _pool(workers: int | None, prefilter) -> ProcessPoolExecutor | None:
    count = workers if workers is not None else min(2, os.cpu_count() or 1)
    if count <= 0:
        return None
    import multiprocessing
    context = multiprocessing.get_context("fork")
    return ProcessPoolExecutor(max_workers=count, mp_context=context, initializer=_init_worker,
                               initargs=(prefilter, os.getpid()))
