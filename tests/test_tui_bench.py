"""Time to first screen and memory of `triage tui` on a big log, in a real terminal (tmux).

Skipped unless LOGTRIAGE_TUI_BENCH names a log, e.g. one from benchmarks/generate.py:
    python benchmarks/generate.py --ranks 64 --size 1G --seed 1 --out .bench/tui-r64-1G.log
    LOGTRIAGE_TUI_BENCH=.bench/tui-r64-1G.log python -m pytest tests/test_tui_bench.py -s

It starts `python -m logtriage tui LOG` in a 120x40 tmux pane and polls the pane every 10 ms:
first screen = the log's first line and the footer are drawn; ready = the verdict is drawn.
Memory is the process's VmRSS / VmHWM from /proc. While the triage runs it presses `down` and
times how long until the cursor's line number on the status line changes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_tui_support import ROOT

LOG = os.environ.get("LOGTRIAGE_TUI_BENCH")
SESSION = "logtriage-tui-bench"

pytestmark = [
    pytest.mark.skipif(not LOG, reason="set LOGTRIAGE_TUI_BENCH to a big log to measure"),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"),
]


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True).stdout


def _screen() -> str:
    return _tmux("capture-pane", "-p", "-t", SESSION)


def _memory(pid: int) -> tuple[int, int]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) // 1024, int(fields["VmHWM"].split()[0]) // 1024


def _app_pid(pane_pid: int) -> int:
    for _ in range(200):
        out = subprocess.run(["pgrep", "-P", str(pane_pid), "-f", "logtriage"], capture_output=True, text=True).stdout
        if out.split():
            return int(out.split()[0])
        if "logtriage" in Path(f"/proc/{pane_pid}/cmdline").read_text():
            return pane_pid
        time.sleep(0.01)
    raise AssertionError("the app did not start")


def _wait(predicate, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate(_screen()):
            return time.monotonic()
        time.sleep(0.01)
    raise AssertionError(f"timed out; screen:\n{_screen()}")


def test_first_screen_of_a_big_log():
    log = Path(LOG).resolve()
    first_line = next(line for line in log.open(errors="replace") if line.strip()).strip()[:40]
    _tmux("kill-session", "-t", SESSION)
    command = f"cd {ROOT} && exec env -u COLUMNS -u LINES {sys.executable} -m logtriage tui {log}"
    start = time.monotonic()
    _tmux("new-session", "-d", "-s", SESSION, "-x", "120", "-y", "40", command)
    try:
        pid = _app_pid(int(_tmux("list-panes", "-t", SESSION, "-F", "#{pane_pid}").split()[0]))
        shown = _wait(lambda s: first_line in s and "q quit" in s, 30)
        rss_first, _ = _memory(pid)
        latencies = []
        for _ in range(3):
            if "FAILED" in _screen():
                break
            before = [l for l in _screen().splitlines() if "line " in l][-1:]
            pressed = time.monotonic()
            _tmux("send-keys", "-t", SESSION, "Down")
            moved = _wait(lambda s: [l for l in s.splitlines() if "line " in l][-1:] != before, 30)
            latencies.append(moved - pressed)
            time.sleep(0.5)
        ready = _wait(lambda s: "FAILED" in s or " OK " in s or "HUNG" in s, 900)
        rss_ready, peak = _memory(pid)
        print(f"\n{log.name}: {log.stat().st_size / 1e9:.2f} GB")
        print(f"first screen {shown - start:.2f} s, RSS then {rss_first} MB")
        print(f"key latency while the triage runs: {', '.join(f'{x * 1000:.0f} ms' for x in latencies)}")
        print(f"triage shown after {ready - start:.1f} s, RSS then {rss_ready} MB, peak RSS {peak} MB")
        print(_screen())
        assert shown - start <= 1.5
    finally:
        _tmux("send-keys", "-t", SESSION, "q")
        time.sleep(0.5)
        _tmux("kill-session", "-t", SESSION)
