"""Inputs the viewer cannot read by offset become plain temporary files ("spools"): standard
input (copied as it arrives, so `torchrun ... 2>&1 | triage tui -` shows the run live) and
gzip files (decompressed in the background). The terminal takes over standard input for keys."""

from __future__ import annotations

import gzip
import os
import tempfile
import threading
import zlib
from typing import Callable

from logtriage.errors import UsageError

BLOCK = 1 << 20


class Spool:
    """Copies a byte stream into a temporary file on a thread."""

    def __init__(self, read: Callable[[int], bytes], name: str, on_close: Callable[[], None] = lambda: None):
        self.name = name
        handle, self.path = tempfile.mkstemp(prefix="logtriage-tui-", suffix=".log")
        self._out = os.fdopen(handle, "wb", buffering=0)
        self._read = read
        self._on_close = on_close
        self.finished = threading.Event()
        self.error: str | None = None
        self.written = 0
        self._thread = threading.Thread(target=self._copy, name=f"spool {name}", daemon=True)

    def start(self) -> "Spool":
        self._thread.start()
        return self

    def _copy(self) -> None:
        try:
            while True:
                data = self._read(BLOCK)
                if not data:
                    break
                self._out.write(data)
                self.written += len(data)
        except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
            self.error = f"{self.name}: stopped reading after {self.written} bytes ({exc})"
        finally:
            self._on_close()
            self.finished.set()

    def fill_head(self, wanted: int, timeout: float) -> None:
        """Wait until `wanted` bytes arrived, the input ended, or `timeout` seconds passed."""
        waited = 0.0
        while self.written < wanted and not self.finished.is_set() and waited < timeout:
            self.finished.wait(0.02)
            waited += 0.02

    def remove(self) -> None:
        self._out.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def spool_stdin() -> Spool:
    """Standard input into a spool; the terminal becomes standard input, for the keyboard."""
    pipe = os.dup(0)
    try:
        tty = os.open("/dev/tty", os.O_RDONLY)
    except OSError:
        os.close(pipe)
        raise UsageError("triage tui reads keys from a terminal, and there is none "
                         "(use `triage LOG` for a report)") from None
    os.dup2(tty, 0)
    os.close(tty)
    return Spool(lambda n: os.read(pipe, n), "<stdin>", lambda: os.close(pipe)).start()


def spool_gzip(path: str, name: str) -> Spool:
    stream = gzip.open(path, "rb")
    return Spool(stream.read, name, stream.close).start()


def is_gzip(path: str) -> bool:
    with open(path, "rb") as handle:
        return handle.read(2) == b"\x1f\x8b"


def spool_fd(fd: int, name: str) -> Spool:
    """A spool fed from an open descriptor (tests: one end of a pipe)."""
    return Spool(lambda n: os.read(fd, n), name, lambda: os.close(fd)).start()
