"""Shared helpers of the `triage tui` tests (no tests here)."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

from textual.worker import WorkerState

from logtriage.tui.app import TriageApp
from logtriage.tui.model.session import resolve

ROOT = Path(__file__).resolve().parents[1]
NP4 = "sample_logs/cpu/rank_exception__np4.log"     # rank 2 KeyError at line 24; ranks 1, 3 gloo errors
SIZE = (120, 40)


def drive(test):
    """Run an `async def` test on its own event loop (no async plugin needed)."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))
    return run


def make_app(*inputs: str, **options) -> TriageApp:
    return TriageApp(resolve(list(inputs)), **options)


async def settle(app: TriageApp, pilot) -> None:
    """Until no worker is pending or running (index, triage, search, filter, split) twice in a row,
    with the messages in between handled."""
    quiet = 0
    for _ in range(100):
        await app.workers.wait_for_complete()
        await pilot.pause()
        busy = any(w.state in (WorkerState.PENDING, WorkerState.RUNNING) for w in app.workers)
        quiet = 0 if busy else quiet + 1
        if quiet >= 2:
            break
    await pilot.pause()


def visible(app: TriageApp) -> list[tuple[int, str]]:
    return app.log_view.visible_lines()


def cursor_line(app: TriageApp) -> int:
    return app.store.line_number(app.log_view.cursor_gid())


def stream_label(app: TriageApp) -> str:
    return app.triaged.rows[app.stream].label


def write_log(path: Path, lines: list[str]) -> Path:
    path.write_bytes(("\n".join(lines) + "\n").encode())
    return path
