"""Opening a run for the viewer, in the order the screen needs it: the first lines at once,
then the whole line index, then the triage, each reporting progress through `Progress`
(written by the worker thread, read by the screen's timer)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Sequence

import numpy as np

from logtriage.ingest.sources import discover
from logtriage.tui.model.lines import HEAD_BYTES, LineStore, extend_index, open_head
from logtriage.tui.model.spool import Spool, is_gzip, spool_gzip

if TYPE_CHECKING:
    from logtriage.api import TriageRun

QUIET_S = 1.0          # a spool that stopped growing this long is triaged as it is


@dataclass(frozen=True)
class Settings:
    """How to triage (the library itself is imported by the worker, after the first screen)."""
    patterns: tuple[str, ...] = ()
    redact: bool = True


class Phase(str, Enum):
    READING = "reading input"
    INDEXING = "indexing"
    TRIAGE = "triage"
    READY = "ready"
    FAILED = "failed"


@dataclass
class Progress:
    phase: Phase = Phase.INDEXING
    done: int = 0
    total: int = 0

    def set(self, phase: Phase, done: int = 0, total: int = 0) -> None:
        self.phase, self.done, self.total = phase, done, total

    @property
    def percent(self) -> int:
        return int(100 * self.done / self.total) if self.total else 0


@dataclass
class Inputs:
    """What the user named, resolved into files the viewer can read by offset."""
    names: list[str]                     # per source, as shown
    paths: list[str]                     # per source, a plain file: the input or its spool
    triage_inputs: list[str]             # what `triage` reads (standard input: its spool)
    spools: list[Spool] = field(default_factory=list)
    renames: dict[str, str] = field(default_factory=dict)   # spool path -> name shown

    def close(self) -> None:
        for spool in self.spools:
            spool.remove()


def resolve(inputs: Sequence[str], stdin: Spool | None = None) -> Inputs:
    """Expand the inputs as `triage` does (folders, .gz, `-`); raises InputError like it."""
    given = [stdin.path if (name == "-" and stdin is not None) else name for name in inputs]
    resolved = Inputs([], [], given, [stdin] if stdin is not None else [])
    if stdin is not None:
        resolved.renames[stdin.path] = stdin.name
    for source in discover(given).sources:
        path = str(source.path)
        name = resolved.renames.get(source.name, source.name)
        if stdin is None or path != stdin.path:
            if is_gzip(path):
                spool = spool_gzip(path, name)
                resolved.spools.append(spool)
                path = spool.path
        resolved.names.append(name)
        resolved.paths.append(path)
    return resolved


def open_store(inputs: Inputs) -> LineStore:
    """Each source with its first lines indexed (a spool gets a moment to fill its head)."""
    for spool in inputs.spools:
        spool.fill_head(HEAD_BYTES, timeout=0.3)
    return LineStore([open_head(name, path) for name, path in zip(inputs.names, inputs.paths)])


def wait_for_spools(inputs: Inputs, progress: Progress, cancelled=lambda: False) -> None:
    """Until every spool ended, or stopped growing for QUIET_S (a live run piped in)."""
    last, still = -1, 0.0
    while not cancelled():
        pending = [s for s in inputs.spools if not s.finished.is_set()]
        if not pending:
            return
        written = sum(s.written for s in inputs.spools)
        progress.set(Phase.READING, written, 0)
        still = still + 0.05 if written == last else 0.0
        if still >= QUIET_S:
            return
        last = written
        time.sleep(0.05)


def full_index(store: LineStore, progress: Progress) -> list[tuple[int, np.ndarray, int]]:
    """(source, offsets, size) for every source, as the files are now. Runs on a worker, on a
    snapshot of the store; the screen installs the result."""
    total = sum(_size(s.fd) for s in store.sources)
    done = 0
    out = []
    for index, source in enumerate(store.sources):
        base = done
        offsets, size = extend_index(source, lambda pos: progress.set(Phase.INDEXING, base + pos, total))
        out.append((index, offsets, size))
        done += size
    return out


def triage(inputs: Inputs, settings: Settings, progress: Progress) -> "TriageRun":
    from logtriage.api import TriageOptions, run_triage
    total = sum(_size_of(p) for p in inputs.paths)
    progress.set(Phase.TRIAGE, 0, total)
    options = TriageOptions(settings.patterns, redact=settings.redact, progress=lambda offset: _add(progress, offset))
    return run_triage(inputs.triage_inputs, options)


def _add(progress: Progress, offset: int) -> None:
    # The callback gives the offset within the current source; keep the bar moving forward.
    progress.done = max(progress.done, offset)


def _size(fd: int) -> int:
    return os.fstat(fd).st_size


def _size_of(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0
