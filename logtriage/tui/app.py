"""The `triage tui` application: layout, loading in the background, and what the screen shows
as the loading goes (first lines at once, the whole index, then the triage)."""

from __future__ import annotations

import time

import numpy as np
from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer
from textual.worker import Worker, WorkerState, get_current_worker

from logtriage.errors import TriageError
from logtriage.tui.navigate import ViewActions, while_shown
from logtriage.tui.textkeys import TextActions
from logtriage.tui.model.align import merge_by_time
from logtriage.tui.model.keys import KEYS
from logtriage.tui.model.lines import extend_index
from logtriage.tui.model.search import Query
from logtriage.tui.model.session import (Inputs, Phase, Progress, Settings, full_index, open_store, triage,
                                         wait_for_spools)
from logtriage.tui.model.streams import Triaged, build_triaged
from logtriage.tui.model.views import Mode
from logtriage.tui.widgets.findings import FindingsPanel
from logtriage.tui.widgets.log_view import LogView
from logtriage.tui.widgets.panels import PromptBar, StatusBar, VerdictLine
from logtriage.tui.widgets.rank_list import RankList
from logtriage.tui.widgets.split_view import SplitView

POLL_S = 0.5
RETRIAGE_QUIET_S = 2.0


class TriageApp(ViewActions, TextActions, App[None]):
    """Browse a failed run rank by rank."""

    TITLE = "triage tui"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    #body { height: 1fr; }
    #right { width: 1fr; }
    #split { display: none; }
    TriageApp.-split #split { display: block; height: 1fr; }
    TriageApp.-split #log { display: none; }
    """
    BINDINGS = [Binding(k.key, k.action, k.label, key_display=k.shown) for k in KEYS]

    def __init__(self, inputs: Inputs, settings: Settings = Settings(), follow: bool = False) -> None:
        super().__init__()
        self.inputs = inputs
        self.settings = settings
        self.progress = Progress()
        self.store = None
        self.triaged: Triaged | None = None
        self.failure: str | None = None
        self.view_mode = Mode.ALL
        self.stream: int | None = None
        self.pinned: int | None = None
        self.errors_only = False
        self.filter: Query | None = None
        self.search_query: Query | None = None
        self.match_rows = np.empty(0, np.int64)
        self.search_cache: dict = {}               # query -> raw candidate lines of the whole input
        self.searching: int | None = None          # percent while a search runs
        self.aligning = False                      # while the split view's rows are computed
        self.default_export = "run.triage.md"
        self.following = follow
        self.steered = False                       # the user moved before the triage was ready
        self.merged_order: np.ndarray | None = None
        self._log: LogView | None = None
        self._widgets: tuple = ()
        self._grew_at = 0.0
        self._triaged_size = 0

    def compose(self) -> ComposeResult:
        yield VerdictLine(id="verdict")
        with Horizontal(id="body"):
            yield RankList(id="ranks")
            with Vertical(id="right"):
                yield LogView(id="log")
                yield SplitView(id="split")
        yield FindingsPanel(id="findings")
        yield StatusBar(id="status")
        yield PromptBar(id="prompt")
        yield Footer(compact=True, show_command_palette=False)

    @property
    def log_view(self) -> LogView:
        return self._log

    def on_mount(self) -> None:
        self._log = self.query_one("#log", LogView)
        self._widgets = tuple(self.query_one(f"#{name}") for name in
                              ("log", "split", "ranks", "findings", "verdict", "status", "prompt"))
        self.store = open_store(self.inputs)
        self.query_one("#verdict", VerdictLine).waiting(self.inputs.names, "indexing…")
        self.query_one("#ranks", RankList).border_title = "streams (triage running)"
        self._show_view(self._base_view(), None)
        self._focus(self.log_view)
        self.set_interval(0.25, self._tick)
        self.set_interval(POLL_S, self._poll_growth)
        self.call_after_refresh(self._load, True)       # the first screen first, then the work

    def on_unmount(self) -> None:
        if self.store is not None:
            self.store.close()

    # --- loading -------------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="load", exit_on_error=False)
    def _load(self, first: bool) -> None:
        worker = get_current_worker()
        try:
            wait_for_spools(self.inputs, self.progress, lambda: worker.is_cancelled)
            indexed = full_index(self.store.snapshot(), self.progress)
            if worker.is_cancelled:
                return
            self.call_from_thread(self._install_index, indexed)
            size = sum(size for _, _, size in indexed)
            run = triage(self.inputs, self.settings, self.progress)
        except TriageError as exc:
            self.progress.set(Phase.FAILED)
            self.call_from_thread(self._load_failed, str(exc))
            return
        if not worker.is_cancelled:
            self.call_from_thread(self._install_triage, run, size, first)

    @while_shown
    def _install_index(self, indexed) -> None:
        keep = self.log_view.cursor_gid()
        where = self.store.locate(keep) if keep is not None else None
        for index, offsets, size in indexed:
            if size >= self.store.sources[index].size:
                self.store.update(index, offsets, size)
        keep = self.store.gid(where[0], where[1] + 1) if where else None
        if self.view_mode is Mode.ALL:
            self._apply_view(keep)

    @while_shown
    def _install_triage(self, run, size: int, first: bool) -> None:
        self._share_index(run)
        self.triaged = build_triaged(run, self.store)
        self._triaged_size = size
        self.progress.set(Phase.READY)
        t = self.triaged
        self.query_one("#ranks", RankList).show(t.rows)
        self.query_one("#findings", FindingsPanel).show(t.findings, self.store.line_number)
        rc = run.report.root_cause
        where = None
        if rc is not None and rc.line is not None:
            where = f"{self.inputs.renames.get(rc.source, rc.source)}:{rc.line}"
        self.query_one("#verdict", VerdictLine).show_report(run.report, where)
        if len(self.store.sources) > 1:
            self._merge_by_time()
        if first and not self.steered and t.root_stream is not None:
            self.action_root_cause()
            self._focus(self.log_view)
        else:
            if first and t.root_gid is not None:
                self.notify("triage ready: r jumps to the root cause", timeout=4)
            self._apply_view(self.log_view.cursor_gid())
        self._status()

    def _share_index(self, run) -> None:
        """Read lines through the scan's own offsets where they are the viewer's: one index in memory."""
        for index, source in enumerate(self.store.sources[:len(run.scan.indexes)]):
            offsets = run.scan.indexes[index].offsets
            if len(offsets) == len(source.offsets) and len(offsets):
                shared = np.frombuffer(offsets, np.int64)
                if np.array_equal(shared, source.offsets):
                    self.store.update(index, shared, source.size)

    @while_shown
    def _load_failed(self, message: str) -> None:
        self.failure = message
        self.query_one("#verdict", VerdictLine).waiting(self.inputs.names, f"triage failed: {message}")
        self.notify(message, title="triage failed", severity="error", markup=False, timeout=10)
        self._status()

    @work(thread=True, exclusive=True, group="merge", exit_on_error=False)
    def _merge_by_time(self) -> None:
        store = self.store.snapshot()
        worker = get_current_worker()
        order = merge_by_time(store.bases, store.read_text, lambda: worker.is_cancelled)
        if order is not None and not worker.is_cancelled:
            self.call_from_thread(self._install_merge, order)

    @while_shown
    def _install_merge(self, order: np.ndarray) -> None:
        if len(order) == self.store.total:
            self.merged_order = order
            if self.view_mode is Mode.ALL:
                self._apply_view(self.log_view.cursor_gid())

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.state is WorkerState.ERROR:
            error = event.worker.error
            self.notify(f"{type(error).__name__}: {error}", title=f"{event.worker.group} failed",
                        severity="error", markup=False, timeout=10)

    # --- a growing file --------------------------------------------------------------------
    @while_shown
    def _poll_growth(self) -> None:
        if self.progress.phase not in (Phase.READY, Phase.FAILED) or not (self.following or self.inputs.spools):
            return
        grew = False
        keep = self.log_view.cursor_gid()
        where = self.store.locate(keep) if keep is not None else None
        for index, source in enumerate(self.store.sources):
            offsets, size = extend_index(source)
            if size != source.size:
                self.store.update(index, offsets, size)
                grew = True
        if grew:
            keep = self.store.gid(where[0], where[1] + 1) if where else None
            self._grew_at = time.monotonic()
            if self.view_mode is Mode.ALL:
                self._apply_view(None if self.following else keep)
            if self.following:
                self.log_view.action_edge(1)
        elif ((self.following or self.inputs.spools) and self.store.size > self._triaged_size
              and time.monotonic() - self._grew_at > RETRIAGE_QUIET_S and self.progress.phase is Phase.READY):
            self._triaged_size = self.store.size
            self.progress.set(Phase.INDEXING)
            self._load(first=False)

    # --- the status line -----------------------------------------------------------------
    @while_shown
    def _tick(self) -> None:
        phase = self.progress.phase
        if phase in (Phase.INDEXING, Phase.TRIAGE, Phase.READING) and self.triaged is None:
            what = f"{phase.value} {self.progress.percent}%…" if self.progress.total else f"{phase.value}…"
            self.query_one("#verdict", VerdictLine).waiting(self.inputs.names, what)
        self._status()

    @while_shown
    def _status(self) -> None:
        log = self.log_view
        view = log.view
        gid = log.cursor_gid()
        parts = [f"{self.view_mode.value}"]
        if self.view_mode is Mode.SPLIT:
            split = self.query_one("#split", SplitView)
            parts.append("aligning…" if self.aligning else f"row {split.cursor + 1:,}/{split.row_count():,}")
        elif gid is not None:
            source = self.store.source_of(gid)
            name = source.name if len(self.store.sources) > 1 else ""
            parts.append(f"{name}:{self.store.line_number(gid)}".lstrip(":") if name else
                         f"line {self.store.line_number(gid):,}")
            parts.append(f"row {log.cursor + 1:,}/{view.count:,}")
        if self.errors_only:
            parts.append("errors only")
        if self.filter is not None:
            parts.append(f"filter /{self.filter.text}/")
        if self.search_query is not None:
            parts.append(self._search_status())
        if self.following:
            parts.append("tail on")
        phase = self.progress.phase
        if phase is Phase.FAILED and self.failure:
            parts.append(f"triage failed: {self.failure}")
        elif phase is not Phase.READY:
            parts.append(f"{phase.value} {self.progress.percent}%" if self.progress.total else phase.value)
        self.query_one("#status", StatusBar).show_parts(parts)

    def _titled(self, widget, title: str, subtitle: str = "") -> None:
        widget.border_title = Text(title)
        widget.border_subtitle = Text(subtitle)
