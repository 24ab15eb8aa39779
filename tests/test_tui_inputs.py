"""`triage tui` on the inputs a real run gives it: hostile text, a growing file, standard input,
a --log-dir folder, a log whose triage is still running; and its command line."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import threading

import pytest

from logtriage.cli import main
from logtriage.tui import app as app_module
from logtriage.tui.model import session
from logtriage.tui.model.keys import KEYS
from logtriage.tui.model.session import resolve
from logtriage.tui.model.spool import spool_fd
from logtriage.tui.app import TriageApp
from logtriage.tui.model.views import Mode
from logtriage.tui.widgets.findings import FindingsPanel
from logtriage.tui.widgets.rank_list import RankList
from test_tui_support import NP4, ROOT, SIZE, cursor_line, drive, make_app, settle, stream_label, visible, write_log

pytestmark = pytest.mark.timeout(120)

HOSTILE = [
    "[rank0]: step 1 loss 0.5",
    "[rank1]: step 1 loss 0.4",
    "[rank1]: [bold]loud[/bold] \x1b]0;pwned\x07 [link=file:///etc/passwd]click[/link]",
    "[rank1]: Traceback (most recent call last):",
    '[rank1]:   File "train.py", line 3, in <module>',
    "[rank1]: RuntimeError: [red]boom[/red] \x1b[2J\x1b[31mred\x1b[0m",
]


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


@drive
async def test_markup_and_escapes_in_a_log_line_are_shown_not_obeyed(tmp_path):
    log = write_log(tmp_path / "hostile.log", HOSTILE)
    app = make_app(str(log))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert stream_label(app) == "rank 1" and cursor_line(app) == 6
        shown = dict(visible(app))
        assert shown[3] == "[bold]loud[/bold] \\x1b]0;pwned\\x07 [link=file:///etc/passwd]click[/link]"
        assert shown[6] == "RuntimeError: [red]boom[/red] \\x1b[2Jred"     # colour codes dropped, others shown
        log_view = app.log_view
        strips = [log_view.render_line(y) for y in range(log_view.scrollable_content_region.height)]
        segments = [seg for strip in strips for seg in strip]
        assert not any("\x1b" in seg.text or "\x07" in seg.text for seg in segments)
        loud = next(seg for seg in segments if "loud" in seg.text)
        assert "[bold]loud[/bold]" in loud.text and not (loud.style and loud.style.bold)
        assert not any(seg.style and seg.style.link for seg in segments)
        panel = app.query_one(FindingsPanel)
        cells = [panel.get_cell_at((row, 5)).plain for row in range(panel.row_count)]
        assert any("[red]boom[/red]" in cell for cell in cells)
        assert "pwned" not in app.title and "pwned" not in (app.sub_title or "")


@drive
async def test_tail_follows_a_growing_file_and_retriages_when_it_pauses(tmp_path, monkeypatch):
    monkeypatch.setattr(app_module, "RETRIAGE_QUIET_S", 0.3)
    monkeypatch.setattr(app_module, "POLL_S", 0.1)
    log = write_log(tmp_path / "live.log", HOSTILE[:2])
    app = make_app(str(log), follow=True)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        # two step lines and nothing more: output that stops, not yet a failure
        first = app.triaged.run.report
        assert first.verdict == "hung" and first.root_cause.rule_id == "hang.output_stopped"
        assert app.view_mode is Mode.STREAM and stream_label(app) == "rank 1"   # where the output stops
        assert app.log_view.view.count == 1
        with open(log, "a") as out:
            out.write("\n".join(HOSTILE[2:]) + "\n")
        for _ in range(40):
            await pilot.pause(0.1)
            if app.triaged.run.report.verdict == "failed":
                break
        await settle(app, pilot)
        assert app.view_mode is Mode.STREAM and stream_label(app) == "rank 1"
        assert app.log_view.view.count == 5   # rank 1's stream, grown by its four new lines
        assert app.triaged.run.report.verdict == "failed"
        assert app.store.total == 6
        assert "tail on" in app.query_one("#status").render().plain


@drive
async def test_standard_input_is_spooled_and_exported_as_stdin(tmp_path):
    read_fd, write_fd = os.pipe()
    spool = spool_fd(read_fd, "<stdin>")
    threading.Thread(target=lambda: (os.write(write_fd, (ROOT / NP4).read_bytes()), os.close(write_fd))).start()
    inputs = resolve(["-"], spool)
    app = TriageApp(inputs)
    target = tmp_path / "stdin.md"
    try:
        async with app.run_test(size=SIZE) as pilot:
            await settle(app, pilot)
            assert inputs.names == ["<stdin>"]
            assert stream_label(app) == "rank 2" and cursor_line(app) == 24
            app._export(str(target))
    finally:
        inputs.close()
    text = target.read_text()
    assert "| where | &lt;stdin&gt;:24 |" in text
    assert spool.path not in text and not os.path.exists(spool.path)


@drive
async def test_a_hang_without_an_error_opens_on_the_stuck_ranks_last_step(tmp_path):
    lines = [f"[rank{r}]: step {s} loss 0.5" for s in range(1, 11) for r in (0, 1) if r == 0 or s <= 3]
    log = write_log(tmp_path / "hang.log", lines)
    app = make_app(str(log))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        report = app.triaged.run.report
        assert report.verdict == "hung" and report.root_cause.line is None
        assert stream_label(app) == "rank 1" and app.store.text(app.log_view.cursor_gid()) == "step 3 loss 0.5"
        rows = {r.label: r.status.value for r in app.query_one(RankList).streams}
        assert rows["rank 1"] == "root cause" and rows["rank 0"] == "hung"


@drive
async def test_a_gzip_log_is_read_through_a_decompressed_spool(tmp_path):
    packed = tmp_path / "run.log.gz"
    packed.write_bytes(gzip.compress((ROOT / NP4).read_bytes()))
    app = make_app(str(packed))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        spool = app.inputs.spools[0].path
        assert app.store.sources[0].name == str(packed) and app.store.sources[0].path == spool
        assert stream_label(app) == "rank 2" and (24, "KeyError: 'target'") in visible(app)
    app.inputs.close()
    assert not os.path.exists(spool)


@drive
async def test_a_log_dir_folder_lists_each_rank_from_its_files():
    folder = "sample_logs/cpu/rank_exception__tee3_logdir_record"
    app = make_app(folder)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        labels = [r.label for r in app.query_one(RankList).streams]
        assert labels[:2] == ["rank 0", "rank 1"]
        report = app.triaged.run.report
        root_source = report.root_cause.source
        assert app.store.source_of(app.log_view.cursor_gid()).name == root_source
        assert cursor_line(app) == report.root_cause.line
        assert "stderr.log:" in app.query_one("#status").render().plain


@drive
async def test_per_rank_files_merge_by_timestamp(tmp_path):
    folder = tmp_path / "logs"
    folder.mkdir()
    write_log(folder / "rank0.log", ["2026-11-30 10:00:01,000 step 1", "2026-11-30 10:00:03,000 step 2",
                                     "  continued without a stamp", "2026-11-30 10:00:05,000 step 3"])
    write_log(folder / "rank1.log", ["2026-11-30 10:00:02,000 step 1", "2026-11-30 10:00:04,000 step 2",
                                     "RuntimeError: boom"])
    app = make_app(str(folder))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert [r.label for r in app.query_one(RankList).streams][:2] == ["rank 0", "rank 1"]
        assert stream_label(app) == "rank 1" and cursor_line(app) == 3
        await pilot.press("m")
        await settle(app, pilot)
        view = app.log_view.view
        assert not view.ordered and view.title == "all streams, by time"
        shown = [(app.store.source_of(view.gid(r)).name.rsplit("/", 1)[-1], app.store.line_number(view.gid(r)))
                 for r in range(view.count)]
        assert shown == [("rank0.log", 1), ("rank1.log", 1), ("rank0.log", 2), ("rank0.log", 3),
                         ("rank1.log", 2), ("rank1.log", 3), ("rank0.log", 4)]
        assert [app.log_view.stream_label(view.gid(r))[0] for r in range(3)] == ["r0", "r1", "r0"]


@drive
async def test_first_screen_shows_the_first_lines_before_the_triage_ends(monkeypatch):
    gate = threading.Event()
    real = session.triage

    def slow_triage(*args, **kwargs):
        gate.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(app_module, "triage", slow_triage)
    app = make_app(NP4)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        first = (ROOT / NP4).read_text().splitlines()
        shown = visible(app)
        assert shown[0] == (1, first[0]) and len(shown) > 10
        assert app.triaged is None and app.view_mode is Mode.ALL
        assert "triage" in app.query_one("#verdict").render().plain
        await pilot.press("down", "down")                 # the screen answers while the triage runs
        assert cursor_line(app) == 3
        gate.set()
        await settle(app, pilot)
        assert app.triaged is not None
        assert cursor_line(app) == 3                      # the user moved first: no jump
        await pilot.press("r")
        assert cursor_line(app) == 24


SAMPLES = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("sample_logs/*/*.log"))[::20]


@pytest.mark.parametrize("path", SAMPLES)
@drive
async def test_every_kind_of_sample_opens_on_its_root_cause_line(path):
    app = make_app(path)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        rc = app.triaged.run.report.root_cause
        if rc is not None and rc.line is not None:
            assert app.store.source_of(app.log_view.cursor_gid()).name == rc.source
            assert cursor_line(app) == rc.line and rc.line in dict(visible(app))
        for key in ("m", "s", "s", "x", "e", "r"):
            await pilot.press(key)
            await settle(app, pilot)


def test_help_lists_every_key_and_the_app_binds_them(capsys):
    assert main(["tui", "--help"]) == 0
    out = capsys.readouterr().out
    for key in KEYS:
        assert f"  {key.shown:<16}  {key.help}" in out
    bound = {b.key: b.action for b in TriageApp.BINDINGS}
    assert bound == {k.key: k.action for k in KEYS}
    assert all(hasattr(TriageApp, f"action_{k.action}") for k in KEYS)


def test_missing_input_is_a_one_line_error(capsys):
    assert main(["tui", "no/such.log"]) == 3
    assert capsys.readouterr().err.strip() == "triage: error: no/such.log: no such file or directory"


def test_the_model_imports_no_textual():
    code = ("import sys, logtriage.tui.model.session, logtriage.tui.model.streams, logtriage.tui.model.search, "
            "logtriage.tui.model.align, logtriage.tui.model.export, logtriage.tui.model.keys; "
            "print('textual' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"
