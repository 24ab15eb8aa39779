"""A progress line on stderr for inputs that take more than a second (TTY only)."""

from __future__ import annotations

import time


class ProgressBar:
    def __init__(self, stream, delay: float = 1.0):
        self.stream = stream
        self.start = time.monotonic()
        self.delay = delay
        self.shown = False

    def __call__(self, offset: int) -> None:
        elapsed = time.monotonic() - self.start
        if elapsed < self.delay:
            return
        self.shown = True
        rate = offset / elapsed / 1e6 if elapsed else 0
        self.stream.write(f"\r  triage: read {offset / 1e6:,.0f} MB ({rate:,.0f} MB/s)")
        self.stream.flush()

    def done(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * 60 + "\r")
            self.stream.flush()
