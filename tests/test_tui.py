"""`triage tui` driven by its keys on real sample logs: what is selected and what is shown."""

from __future__ import annotations

import pytest
from textual.widgets import Input

from logtriage.tui.model.streams import Mark, Status
from logtriage.tui.model.views import Mode
from logtriage.tui.widgets.findings import FindingsPanel
from logtriage.tui.widgets.panels import PromptBar, StatusBar
from logtriage.tui.widgets.rank_list import ROOT_MARK, RankList
from logtriage.tui.widgets.rule_screen import RuleScreen
from logtriage.tui.widgets.split_view import SplitView
from test_tui_support import NP4, ROOT, SIZE, cursor_line, drive, make_app, settle, stream_label, visible

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


async def _type(pilot, app, key: str, text: str) -> None:
    await pilot.press(key)
    app.query_one(PromptBar).query_one(Input).value = text
    await pilot.press("enter")
    await settle(app, pilot)


@drive
async def test_opens_on_the_root_rank_with_its_failing_line_in_view():
    app = make_app(NP4)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        ranks = app.query_one(RankList)
        assert app.view_mode is Mode.STREAM and stream_label(app) == "rank 2"
        assert ranks.streams[ranks.cursor_row].label == "rank 2"
        assert ranks.streams[ranks.cursor_row].status is Status.ROOT_CAUSE
        marker, label, status = (ranks.get_cell_at((ranks.cursor_row, c)).plain for c in range(3))
        assert (marker, label, status) == (ROOT_MARK, "rank 2", "root cause")
        assert cursor_line(app) == 24
        assert (24, "KeyError: 'target'") in visible(app)
        assert app.log_view.marks[app.log_view.cursor_gid()] is Mark.INITIATING
        # every stream is listed, prefixes are stripped in the stream view
        assert [r.label for r in ranks.streams] == ["rank 0", "rank 1", "rank 2", "rank 3", "launcher", "unattributed"]
        assert (13, "Traceback (most recent call last):") in visible(app)


@drive
async def test_rank_statuses_and_counts_match_the_report():
    app = make_app(NP4)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        rows = {r.label: r for r in app.query_one(RankList).streams}
        assert rows["rank 0"].status is Status.KILLED
        assert rows["rank 1"].status is Status.CASCADE and rows["rank 3"].status is Status.CASCADE
        assert (rows["rank 1"].lines, rows["rank 2"].lines, rows["rank 2"].last_step) == (20, 14, 2)
        assert sum(r.lines for r in rows.values()) == 117


@drive
async def test_choosing_a_rank_shows_its_first_error_and_r_returns_to_the_root_cause():
    app = make_app(NP4)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        app.query_one(RankList).focus()
        await pilot.press("up")                       # rank 1
        await settle(app, pilot)
        assert stream_label(app) == "rank 1"
        assert cursor_line(app) == 43
        assert all(number in range(25, 44) or number < 25 for number, _ in visible(app))
        assert [number for number, _ in visible(app)] == [6, 11, *range(26, 44)]   # rank 1's own lines
        await pilot.press("r")
        await settle(app, pilot)
        assert stream_label(app) == "rank 2" and cursor_line(app) == 24


@drive
async def test_next_and_previous_finding_walk_the_marked_lines_in_input_order():
    app = make_app(NP4)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("m")                        # every stream
        await settle(app, pilot)
        assert app.view_mode is Mode.ALL
        app.log_view.goto_row(0)
        marked = sorted(app.store.line_number(g) for g in app.triaged.marks)
        seen = []
        for _ in range(4):
            await pilot.press("e")
            seen.append(cursor_line(app))
        assert seen == marked[:4]
        await pilot.press("E")
        assert cursor_line(app) == marked[2]


@drive
async def test_search_counts_matches_and_n_moves_between_them():
    app = make_app(NP4)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await _type(pilot, app, "slash", "loss")     # rank 2 printed two loss lines
        assert [app.store.line_number(app.log_view.view.gid(r)) for r in app.match_rows] == [7, 10]
        assert cursor_line(app) == 7                 # wrapped from the end of the view to the first match
        status = app.query_one(StatusBar).render().plain
        assert "search /loss/: 1/2 matches" in status
        await pilot.press("n")
        assert cursor_line(app) == 10
        await pilot.press("N")
        assert cursor_line(app) == 7
        await pilot.press("m")                        # all streams: 7 loss lines in the log
        await settle(app, pilot)
        assert len(app.match_rows) == sum(1 for line in open(NP4) if "loss" in line.lower())


@drive
async def test_typing_a_new_search_replaces_the_last_one():
    app = make_app(NP4)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("m", "slash", *"gloo", "enter")
        await settle(app, pilot)
        assert app.search_query.text == "gloo" and len(app.match_rows) == 3
        await pilot.press("slash", *"sigterm", "enter", "n")        # keys typed at once land in the prompt
        await settle(app, pilot)
        assert app.search_query.text == "sigterm" and app.view_mode is Mode.ALL
        assert "SIGTERM" in app.store.text(app.log_view.cursor_gid())
        await pilot.press("ampersand", "enter")                     # an empty filter: no filter
        await settle(app, pilot)
        assert app.filter is None and app.log_view.view.count == 117


@drive
async def test_search_is_case_insensitive_unless_it_has_capitals_and_bad_regex_is_literal():
    app = make_app(NP4)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("m")
        await _type(pilot, app, "slash", "keyerror")
        assert len(app.match_rows) == 1
        await _type(pilot, app, "slash", "Keyerror")
        assert len(app.match_rows) == 0
        await _type(pilot, app, "slash", "batch[")      # not a valid regex: searched literally
        assert [app.store.line_number(app.log_view.view.gid(r)) for r in app.match_rows] == [22]


@drive
async def test_filter_keeps_matching_lines_and_an_empty_pattern_restores_the_view():
    app = make_app(NP4)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("m")
        await settle(app, pilot)
        await _type(pilot, app, "ampersand", "SIGTERM")
        shown = [app.store.text(app.log_view.view.gid(r)) for r in range(app.log_view.view.count)]
        assert shown and all("SIGTERM" in text for text in shown)
        assert len(shown) == sum(1 for line in open(NP4) if "SIGTERM" in line)
        await _type(pilot, app, "ampersand", "")
        assert app.log_view.view.count == 117


@drive
async def test_a_filter_follows_rank_changes_and_a_jump_to_a_hidden_line_drops_it():
    app = make_app(NP4)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await _type(pilot, app, "ampersand", "loss")
        app.query_one(RankList).focus()
        await pilot.press("up")                                       # rank 1, still filtered
        await settle(app, pilot)
        view = app.log_view.view
        assert stream_label(app) == "rank 1" and app.filter is not None
        assert [app.store.line_number(view.gid(r)) for r in range(view.count)] == [6, 11, 32, 35]
        panel = app.query_one(FindingsPanel)
        panel.focus()
        await pilot.press("down", "enter")                            # gloo error at line 43: no "loss"
        await settle(app, pilot)
        assert app.filter is None and cursor_line(app) == 43


@drive
async def test_errors_only_shows_findings_and_their_tracebacks():
    app = make_app(NP4)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("x")
        await settle(app, pilot)
        lines = [app.store.line_number(app.log_view.view.gid(r)) for r in range(app.log_view.view.count)]
        assert lines == list(range(13, 25))          # rank 2's traceback, nothing else of rank 2
        await pilot.press("x")
        await settle(app, pilot)
        assert app.log_view.view.count == 14


@drive
async def test_selecting_a_finding_jumps_to_its_line_in_its_stream():
    app = make_app(NP4)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        panel = app.query_one(FindingsPanel)
        panel.focus()
        await pilot.press("down", "enter")            # chain entry 2: gloo.connection_closed, rank 1, line 43
        await settle(app, pilot)
        assert panel.findings[1].rule.id == "gloo.connection_closed"
        assert stream_label(app) == "rank 1" and cursor_line(app) == 43
        assert app.query_one(RankList).cursor_row == app.stream
        assert any(number == 43 for number, _ in visible(app))


@drive
async def test_question_mark_explains_the_rule_of_the_finding():
    app = make_app(NP4)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("question_mark")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, RuleScreen) and screen.rule.id == "python.exception"
        text = screen.query_one("#rule-text").render().plain
        assert "What it means" in text and "What to do" in text and "Don't conclude" in text
        assert " ".join(screen.rule.fix.split())[:40] in " ".join(text.split())
        await pilot.press("escape")
        assert not isinstance(app.screen, RuleScreen)
        panel = app.query_one(FindingsPanel)
        panel.focus()
        await pilot.press("down", "question_mark")
        await pilot.pause()
        assert app.screen.rule.id == "gloo.connection_closed"


@drive
async def test_export_writes_the_markdown_report(tmp_path):
    target = tmp_path / "incident.md"
    app = make_app(NP4)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await _type(pilot, app, "w", str(target))
    text = target.read_text()
    assert text.startswith("## triage: failed — rank 2: Unhandled Python exception")
    assert "### Causal chain" in text and "rank\\_exception\\_\\_np4.log:24" in text


@drive
async def test_export_to_the_default_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = make_app(str(ROOT / NP4))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("w", "enter")
        await settle(app, pilot)
    assert (tmp_path / "rank_exception__np4.triage.md").read_text().startswith("## triage: failed — rank 2")


@drive
async def test_split_view_puts_the_root_rank_beside_a_cascading_rank_aligned_on_step():
    app = make_app(NP4)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("s")
        await settle(app, pilot)
        split = app.query_one(SplitView)
        assert app.view_mode is Mode.SPLIT and split.display
        left, right = (app.triaged.rows[s].label for s in split.streams)
        assert (left, right) == ("rank 2", "rank 1")
        assert split.rows.basis.value == "step"
        pairs = [(app.store.line_number(l) if l >= 0 else None, app.store.line_number(r) if r >= 0 else None)
                 for l, r in zip(split.rows.left.tolist(), split.rows.right.tolist())]
        assert pairs[:2] == [(7, 6), (10, 11)]       # step 1 beside step 1, step 2 beside step 2
        app.query_one(RankList).focus()
        await pilot.press("down")                     # rank 3 on the right, rank 2 stays on the left
        await settle(app, pilot)
        assert [app.triaged.rows[s].label for s in split.streams] == ["rank 2", "rank 3"]
        await pilot.press("s")
        await settle(app, pilot)
        assert app.view_mode is Mode.STREAM and not split.display


@drive
async def test_merged_view_labels_each_line_with_its_rank():
    app = make_app(NP4)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("m")
        await settle(app, pilot)
        log = app.log_view
        assert log.view.count == 117 and cursor_line(app) == 24    # the cursor stays on its line
        labels = {app.store.line_number(g): log.stream_label(g)[0] for g in range(117)}
        assert (labels[7], labels[6], labels[43], labels[62]) == ("r2", "r1", "r1", "lnch")
        assert log.stream_label(6)[1] != log.stream_label(7)[1]          # different colours
        await pilot.press("m")
        await settle(app, pilot)
        assert app.view_mode is Mode.STREAM and stream_label(app) == "rank 2"
