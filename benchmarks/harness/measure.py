"""Run one command and measure it: wall time, CPU time and peak RSS, from the kernel.

The child is reaped with os.wait4, which returns that child's own resource usage (the same
numbers `/usr/bin/time -v` prints: it uses wait4 too), so no wrapper process sits in the timing.
Peak RSS is the largest single process of the child's tree (the kernel's ru_maxrss), not a sum.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Sequence


@dataclass(frozen=True)
class Timing:
    wall_s: float
    user_s: float
    sys_s: float
    maxrss_kb: int
    returncode: int
    stderr_tail: str      # the last lines the command wrote to stderr (for failures)
    stdout_head: str = ""  # only when asked for (grep -c prints its count)

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def run_timed(argv: Sequence[str], cwd: Path | None = None, stdout_path: Path | None = None,
              keep_stdout: bool = False, ok_codes: tuple[int, ...] = (0,)) -> Timing:
    """Run argv with stdout to /dev/null (or `stdout_path`), stderr to a temporary file."""
    with tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as out:
        if stdout_path is not None:
            sink = open(stdout_path, "wb")
        elif keep_stdout:
            sink = out
        else:
            sink = subprocess.DEVNULL
        try:
            started = time.perf_counter()
            proc = subprocess.Popen(list(argv), cwd=cwd, stdout=sink, stderr=err, stdin=subprocess.DEVNULL)
            _, status, usage = os.wait4(proc.pid, 0)
            wall = time.perf_counter() - started
            proc.returncode = os.waitstatus_to_exitcode(status)
        finally:
            if stdout_path is not None:
                sink.close()
        err.seek(0)
        tail = err.read()[-4000:].decode("utf-8", "replace").strip().splitlines()[-3:]
        head = ""
        if keep_stdout and stdout_path is None:
            out.seek(0)
            head = out.read(4000).decode("utf-8", "replace").strip()
    code = 0 if proc.returncode in ok_codes else proc.returncode
    return Timing(wall, usage.ru_utime, usage.ru_stime, usage.ru_maxrss, code, " | ".join(tail), head)


@dataclass(frozen=True)
class Series:
    """Repeated timings of one command on one input."""

    runs: tuple[Timing, ...]

    @property
    def median_wall(self) -> float:
        return median(t.wall_s for t in self.runs)

    @property
    def min_wall(self) -> float:
        return min(t.wall_s for t in self.runs)

    @property
    def max_wall(self) -> float:
        return max(t.wall_s for t in self.runs)

    @property
    def median_cpu(self) -> float:
        return median(t.user_s + t.sys_s for t in self.runs)

    @property
    def peak_rss_kb(self) -> int:
        return max(t.maxrss_kb for t in self.runs)

    @property
    def failures(self) -> list[Timing]:
        return [t for t in self.runs if not t.ok]


def paired_ratios(a: Series, b: Series) -> list[float]:
    """a/b for each pair (the i-th run of each was measured back to back)."""
    return [x.wall_s / y.wall_s for x, y in zip(a.runs, b.runs) if y.wall_s > 0]


def alternate(pair_index: int, first: str, second: str) -> tuple[str, str]:
    """Order of the two commands in pair i: swapped every other pair so drift cancels out."""
    return (first, second) if pair_index % 2 == 0 else (second, first)
