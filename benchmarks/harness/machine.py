"""Where and on what a benchmark ran: cores, memory, CPU model, tools, commit, date."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path


@dataclass(frozen=True)
class Machine:
    cores: int
    ram_gib: float
    cpu_model: str
    python: str
    grep: str
    locale: str
    commit: str
    date: str
    load_avg: str

    def summary(self) -> str:
        return (f"{self.cores} cores ({self.cpu_model}), {self.ram_gib:.0f} GiB RAM, Python {self.python}, "
                f"{self.grep}, locale {self.locale}; commit {self.commit}; {self.date}; "
                f"load average at start {self.load_avg}")


def _first_line(argv: list[str], cwd: Path | None = None) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=30)
        return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _meminfo_gib() -> float:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return 0.0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit_of(repo: Path) -> str:
    sha = _first_line(["git", "rev-parse", "--short", "HEAD"], repo) or "unknown"
    dirty = _first_line(["git", "status", "--porcelain", "--untracked-files=no"], repo)
    return f"{sha} (with uncommitted changes)" if dirty else sha


def describe_machine(repo: Path) -> Machine:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    locale = os.environ.get("LC_ALL") or os.environ.get("LC_CTYPE") or os.environ.get("LANG") or "C (unset)"
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return Machine(
        cores=cores, ram_gib=_meminfo_gib(), cpu_model=_cpu_model(),
        python=sys.version.split()[0], grep=_first_line(["grep", "--version"]) or "grep (version unknown)",
        locale=locale, commit=commit_of(repo),
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), load_avg=load,
    )
