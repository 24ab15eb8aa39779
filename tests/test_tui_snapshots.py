"""The look of `triage tui`'s main screens, pinned as SVG snapshots (tests/__snapshots__/).

Regenerate them only by command, after looking at the change:
    python -m pytest tests/test_tui_snapshots.py --snapshot-update
"""

from __future__ import annotations

import pytest

from test_tui_inputs import HOSTILE
from test_tui_support import NP4, ROOT, SIZE, make_app, settle, write_log

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


async def _ready(pilot) -> None:
    await settle(pilot.app, pilot)


def _pressing(*keys: str):
    async def run(pilot) -> None:
        await settle(pilot.app, pilot)
        for key in keys:
            await pilot.press(key)
            await settle(pilot.app, pilot)
    return run


def test_opens_on_the_root_cause(snap_compare):
    """rank 2 selected and marked, its KeyError line under the cursor, the chain below."""
    assert snap_compare(make_app(NP4), terminal_size=SIZE, run_before=_ready)


def test_merged_view_coloured_by_rank(snap_compare):
    assert snap_compare(make_app(NP4), terminal_size=SIZE, run_before=_pressing("m"))


def test_split_view_aligned_on_step(snap_compare):
    assert snap_compare(make_app(NP4), terminal_size=SIZE, run_before=_pressing("s"))


def test_errors_only(snap_compare):
    assert snap_compare(make_app(NP4), terminal_size=SIZE, run_before=_pressing("m", "x"))


def test_rule_explanation(snap_compare):
    assert snap_compare(make_app(NP4), terminal_size=SIZE, run_before=_pressing("question_mark"))


def test_search_matches_highlighted(snap_compare):
    async def run(pilot) -> None:
        await settle(pilot.app, pilot)
        await pilot.press("m", "slash", *"gloo", "enter")
        await settle(pilot.app, pilot)
    assert snap_compare(make_app(NP4), terminal_size=SIZE, run_before=run)


def test_hostile_line_shown_literally(snap_compare, tmp_path, monkeypatch):
    """`[bold]`, an OSC title and a clear-screen escape appear as text; nothing is bold or cleared."""
    monkeypatch.chdir(tmp_path)
    write_log(tmp_path / "hostile.log", HOSTILE)
    assert snap_compare(make_app("hostile.log"), terminal_size=SIZE, run_before=_ready)


def test_search_prompt_open(snap_compare):
    """The prompt is one line at the bottom; what is typed shows; the footer says escape cancels."""
    async def run(pilot) -> None:
        await settle(pilot.app, pilot)
        await pilot.press("slash", *"KeyErr")
        await pilot.pause()
    assert snap_compare(make_app(NP4), terminal_size=SIZE, run_before=run)
