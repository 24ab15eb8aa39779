"""What the keys do to the view: which lines are shown (a stream, every stream, two side by
side), where the cursor goes (a finding, the root cause). A mixin of `TriageApp` (app.py holds
the layout and the loading); the split view's alignment runs in a worker thread."""

from __future__ import annotations

import functools

import numpy as np
from textual import work
from textual.worker import get_current_worker

from logtriage.tui.model.align import split_rows
from logtriage.tui.model.streams import Mark, Status
from logtriage.tui.model.views import Mode, View
from logtriage.tui.widgets.canvas import LineCanvas
from logtriage.tui.widgets.findings import FindingsPanel
from logtriage.tui.widgets.panels import PromptBar
from logtriage.tui.widgets.rank_list import RankList
from logtriage.tui.widgets.split_view import SplitView

PALETTE = ("#5fafff", "#87d787", "#ffaf5f", "#d787ff", "#5fd7d7", "#ffd75f", "#ff87af", "#afaf87",
           "#87afff", "#d7af87", "#5fd787", "#af87d7")
OTHER_LABELS = {"launcher": ("lnch", "grey62"), "banner": ("bnr", "grey50"), "probe": ("prb", "grey50"),
                "unattributed": ("?", "grey42")}


def while_shown(method):
    """For callbacks of timers and workers: nothing to do once the app's widgets are going
    (they are removed one by one when the app ends)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        widgets = getattr(self, "_widgets", ())
        if not widgets or not all(w.is_attached for w in widgets):
            return None
        return method(self, *args, **kwargs)
    return run


class ViewActions:
    """Mixed into TriageApp; uses its state (store, triaged, view_mode, stream, filter...)."""

    # --- views -------------------------------------------------------------------------------
    def _base_view(self) -> View:
        t = self.triaged
        if self.view_mode is Mode.STREAM and t is not None and self.stream is not None:
            row = t.rows[self.stream]
            view = View.of(f"{row.label} · {row.status.value}", t.stream_gids(self.stream))
        elif self.merged_order is not None and len(self.merged_order) == self.store.total:
            view = View.of("all streams, by time", self.merged_order, ordered=False)
        else:
            view = View.every_line("all streams, input order" if t else "all lines (triage running)", self.store.total)
        if self.errors_only and t is not None:
            view = view.subset(f"{view.title} · errors only", t.errors)
        return view

    def _apply_view(self, keep_gid: int | None) -> None:
        view = self._base_view()
        if self.filter is not None:
            self._filter_worker(view, self.filter, keep_gid)
        else:
            self._show_view(view, keep_gid)

    def _show_view(self, view: View, keep_gid: int | None) -> None:
        log = self.log_view
        t = self.triaged
        log.marks = t.marks if t is not None else {}
        log.stream_label = self._label_of if (t is not None and self.view_mode is Mode.ALL) else None
        log.search = self.search_query
        log.show(self.store, view, keep_gid)
        self._titled(log, view.title, f"{view.count:,} lines")
        self.match_rows = np.empty(0, np.int64)
        if self.search_query is not None:
            self._start_search(view, self.search_query, False)
        self._status()

    def _focus(self, widget) -> None:
        """Focus now (Widget.focus waits for the queue, behind keys already typed), and never
        away from an open prompt."""
        if not self.query_one("#prompt", PromptBar).is_open:
            self.screen.set_focus(widget)

    def _label_of(self, gid: int) -> tuple[str, str]:
        stream = self.triaged.stream_at(gid)
        if stream is None:
            return "", ""
        key = self.triaged.rows[stream].key
        if key.kind.value == "rank":
            return f"r{key.rank}" + (f".{key.attempt}" if key.attempt else ""), PALETTE[key.rank % len(PALETTE)]
        return OTHER_LABELS.get(key.kind.value, ("", ""))

    def _show_stream(self, stream: int | None, gid: int | None, must_show: bool = True) -> None:
        """Select a stream in the rank list and show it, the cursor on `gid`. `must_show`: a jump
        to that very line (a finding, the root cause), so a filter or errors-only that would hide
        it is dropped; otherwise (choosing a rank) they stay and the cursor goes where it can."""
        self._leave_split()
        self.view_mode = Mode.STREAM if stream is not None else Mode.ALL
        self.stream = stream
        if stream is not None:
            self.query_one("#ranks", RankList).select(stream)
        view = self._base_view()
        if must_show and gid is not None and view.row_of(gid) is None:
            self.errors_only = False
            view = self._base_view()
        if must_show and self.filter is not None and gid is not None and not self.filter.matches(self.store.text(gid)):
            self.filter = None
            self.notify("filter cleared to show that line", timeout=3)
        if self.filter is not None:
            self._filter_worker(view, self.filter, gid)
        else:
            self._show_view(view, gid)

    def goto_gid(self, gid: int) -> None:
        row = self.log_view.view.row_of(gid) if self.view_mode is not Mode.SPLIT else None
        if row is not None:
            self.log_view.goto_row(row)
            return
        self._show_stream(self.triaged.stream_at(gid) if self.triaged else None, gid)

    # Handlers by name: Textual collects @on decorators only from App subclasses, not from mixins.
    def on_rank_list_chosen(self, event: RankList.Chosen) -> None:
        t = self.triaged
        if t is None:
            return
        if self.view_mode is Mode.SPLIT:
            if event.stream != self.pinned:
                self._split_worker(self.pinned, event.stream)
            return
        if event.stream != self.stream or self.view_mode is not Mode.STREAM:
            gids = t.stream_gids(event.stream)
            errors = [g for g in gids[np.isin(gids, t.errors)].tolist() if t.marks.get(g) not in (None, Mark.CONTEXT)]
            target = errors[0] if errors else (int(gids[-1]) if len(gids) else None)
            self._show_stream(event.stream, target, must_show=False)
        if event.activated:
            self._focus(self.log_view)

    def on_line_canvas_cursor_moved(self, event: LineCanvas.CursorMoved) -> None:
        if event.by_user and self.triaged is None:
            self.steered = True
        self._status()

    def on_findings_panel_chosen(self, event: FindingsPanel.Chosen) -> None:
        self.goto_gid(event.finding.gid)
        self._focus(self.log_view)

    # --- keys: findings and the root cause ---------------------------------------------------
    def action_root_cause(self) -> None:
        t = self.triaged
        if t is None:
            self.notify("the triage is still running", timeout=3)
            return
        if t.root_stream is None and t.root_gid is None:
            self.notify("no root cause: the run did not fail", timeout=3)
            return
        self._show_stream(t.root_stream, t.root_gid)

    def action_next_finding(self) -> None:
        self._finding_step(1)

    def action_previous_finding(self) -> None:
        self._finding_step(-1)

    def _finding_step(self, direction: int) -> None:
        if self.triaged is None or self.view_mode is Mode.SPLIT:
            return
        log = self.log_view
        rows = log.view.rows_of(np.array(sorted(self.triaged.marks), np.int64))
        self._row_step(rows, direction, "finding")

    def _row_step(self, rows: np.ndarray, direction: int, what: str) -> None:
        log = self.log_view
        ahead = rows[rows > log.cursor] if direction > 0 else rows[rows < log.cursor][::-1]
        if len(ahead):
            log.goto_row(int(ahead[0]), by_user=True)
        elif len(rows):
            log.goto_row(int(rows[0] if direction > 0 else rows[-1]), by_user=True)
            self.notify(f"{what}s wrapped around", timeout=2)
        else:
            self.notify(f"no {what} in this view", timeout=2)

    # --- keys: views ---------------------------------------------------------------------------
    def action_merged(self) -> None:
        if self.triaged is None:
            return
        keep = self.log_view.cursor_gid()
        self._leave_split()
        if self.view_mode is Mode.ALL:
            self.view_mode = Mode.STREAM
            self.stream = self.triaged.stream_at(keep) if keep is not None else self.triaged.root_stream
            if self.stream is not None:
                self.query_one("#ranks", RankList).select(self.stream)
        else:
            self.view_mode = Mode.ALL
        self._apply_view(keep)

    def action_split(self) -> None:
        t = self.triaged
        if t is None:
            return
        if self.view_mode is Mode.SPLIT:
            self._show_stream(self.query_one("#split", SplitView).streams[1], None)
            return
        left = self.stream if self.stream is not None else t.root_stream
        if left is None:
            return
        chosen = self.query_one("#ranks", RankList).cursor_row
        right = chosen if chosen != left else self._partner(left)
        self.view_mode = Mode.SPLIT
        self.pinned = left
        self.add_class("-split")
        self._split_worker(left, right)

    def _partner(self, left: int) -> int:
        """The stream to compare with: the first other rank that failed, else the next rank."""
        rows = self.triaged.rows
        ranks = [i for i, r in enumerate(rows) if i != left and r.key.kind.value == "rank"]
        failed = [i for i in ranks if rows[i].status in (Status.ROOT_CAUSE, Status.CASCADE, Status.FAILED)]
        return (failed or ranks or [i for i in range(len(rows)) if i != left] or [left])[0]

    def _leave_split(self) -> None:
        if self.view_mode is Mode.SPLIT:
            self.view_mode = Mode.STREAM
            self.remove_class("-split")

    @work(thread=True, exclusive=True, group="split", exit_on_error=False)
    def _split_worker(self, left: int, right: int) -> None:
        self.aligning = True
        t = self.triaged
        store = self.store.snapshot()
        rows = split_rows(t.stream_gids(left), t.stream_gids(right), store.raw, store.read_text)
        if not get_current_worker().is_cancelled:
            self.call_from_thread(self._install_split, left, right, rows)

    @while_shown
    def _install_split(self, left: int, right: int, rows) -> None:
        self.aligning = False
        if self.view_mode is not Mode.SPLIT:
            return
        split = self.query_one("#split", SplitView)
        split.show(self.store, rows, (left, right), self.triaged.marks)
        names = self.triaged.rows
        self._titled(split, f"{names[left].label} │ {names[right].label}", f"aligned on {rows.basis.value}")
        self._focus(split)
        self._status()
