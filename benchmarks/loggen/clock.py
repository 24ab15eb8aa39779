"""A simulated wall clock and the four timestamp shapes a torchrun console log carries.

Formatting a datetime per line would dominate the generator's cost, so the parts that change
once a second are cached per second and only the fraction is formatted per line.
"""

from __future__ import annotations

from datetime import datetime, timedelta


class SimClock:
    """Microseconds since `start`; only moves forward. Jitter arguments place one line a little
    after `now` (processes do not write in lockstep)."""

    def __init__(self, start: datetime):
        self._start = start
        self.now_us = 0
        self._seconds: dict[int, tuple[str, str, str]] = {}

    def at(self, now_us: int) -> "SimClock":
        """A separate clock on the same timeline, set to `now_us`."""
        clone = SimClock(self._start)
        clone.now_us = now_us
        return clone

    def advance(self, microseconds: int) -> None:
        if microseconds > 0:
            self.now_us += microseconds

    def _parts(self, sec: int) -> tuple[str, str, str]:
        """(`2026-11-30 00:01:41`, `1130 00:01:41`, `2026-11-30_00:01:41`) for one second."""
        parts = self._seconds.get(sec)
        if parts is None:
            if len(self._seconds) > 16:
                self._seconds.clear()
            moment = self._start + timedelta(seconds=sec)
            parts = (moment.strftime("%Y-%m-%d %H:%M:%S"), moment.strftime("%m%d %H:%M:%S"),
                     moment.strftime("%Y-%m-%d_%H:%M:%S"))
            self._seconds[sec] = parts
        return parts

    def logging_ts(self, jitter_us: int = 0) -> str:
        """Python logging's asctime: `2026-11-30 00:01:41,740`."""
        t = self.now_us + jitter_us
        return f"{self._parts(t // 1_000_000)[0]},{t // 1000 % 1000:03d}"

    def cpp_glog(self, level: str, nanos_jitter: int = 0) -> str:
        """c10 logging header body: `I1130 00:01:08.161225451` (nanoseconds, no pid)."""
        t = self.now_us * 1000 + nanos_jitter
        return f"{level}{self._parts(t // 1_000_000_000)[1]}.{t % 1_000_000_000:09d}"

    def py_glog(self, level: str) -> str:
        """The launcher's py-glog header start: `W1130 00:01:08.161000` (ms, padded to 6)."""
        return f"{level}{self._parts(self.now_us // 1_000_000)[1]}.{self.now_us // 1000 % 1000:03d}000"

    def childfailed_time(self) -> str:
        """The ChildFailedError `time` field: `2026-11-30_00:01:41`."""
        return self._parts(self.now_us // 1_000_000)[2]
