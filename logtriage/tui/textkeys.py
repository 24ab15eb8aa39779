"""What the keys do with text: search, filter, errors only, follow, explain a rule, export the
report. A mixin of `TriageApp`; searching and filtering a big log run in worker threads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from textual import work
from textual.worker import get_current_worker

from logtriage.errors import TriageError
from logtriage.tui.model.export import export_markdown
from logtriage.tui.model.search import Query, matching_gids
from logtriage.tui.model.views import Mode, View
from logtriage.tui.navigate import while_shown
from logtriage.tui.widgets.findings import FindingsPanel
from logtriage.tui.widgets.panels import PromptBar
from logtriage.tui.widgets.rule_screen import RuleScreen


class TextActions:
    """Mixed into TriageApp with ViewActions."""

    # --- keys: search and filter ---------------------------------------------------------------
    def action_search(self) -> None:
        if self.view_mode is Mode.SPLIT:
            self.notify("search works in the log view (s leaves the split)", timeout=3)
            return
        last = self.search_query.text if self.search_query else None
        self.query_one("#prompt", PromptBar).ask("search", "search /", f"now /{last}/; empty: no search" if last else "")

    def action_filter(self) -> None:
        if self.view_mode is Mode.SPLIT:
            return
        last = self.filter.text if self.filter else None
        self.query_one("#prompt", PromptBar).ask("filter", "show lines matching &",
                                                 f"now /{last}/; empty: every line" if last else "")

    def action_next_match(self) -> None:
        self._row_step(self.match_rows, 1, "match")

    def action_previous_match(self) -> None:
        self._row_step(self.match_rows, -1, "match")

    def action_errors_only(self) -> None:
        if self.triaged is None:
            self.notify("errors are known when the triage is done", timeout=3)
            return
        self.errors_only = not self.errors_only
        self._apply_view(self.log_view.cursor_gid())

    def on_prompt_bar_answered(self, event: PromptBar.Answered) -> None:
        self.screen.set_focus(self.log_view)
        if event.value is None:
            return
        text = event.value
        if event.purpose == "search":
            self.search_query = Query.parse(text) if text else None
            self.log_view.search = self.search_query
            self.log_view.redraw()
            self.match_rows = np.empty(0, np.int64)
            if self.search_query is not None:
                self._start_search(self.log_view.view, self.search_query, True)
            self._status()
        elif event.purpose == "filter":
            self.filter = Query.parse(text) if text else None
            self._apply_view(self.log_view.cursor_gid())
        elif event.purpose == "export":
            self._export(text)

    def _start_search(self, view: View, query: Query, jump: bool) -> None:
        self.searching = 0                  # the status says "searching" from now, not "0 matches"
        self._search_worker(view, query, jump)

    @work(thread=True, exclusive=True, group="search", exit_on_error=False)
    def _search_worker(self, view: View, query: Query, jump: bool) -> None:
        worker = get_current_worker()
        store = self.store.snapshot()
        gids = matching_gids(store, view, query, lambda done, total: setattr(self, "searching", 100 * done // total),
                             lambda: worker.is_cancelled, self.search_cache)
        if gids is not None and not worker.is_cancelled:
            self.call_from_thread(self._install_matches, view, query, gids, jump)

    @while_shown
    def _install_matches(self, view: View, query: Query, gids: np.ndarray, jump: bool) -> None:
        self.searching = None
        if view is not self.log_view.view or query is not self.search_query:
            return
        self.match_rows = view.rows_of(gids) if view.ordered else np.sort(view.rows_of(gids))
        if jump and len(self.match_rows):
            at = self.match_rows[self.match_rows >= self.log_view.cursor]
            self.log_view.goto_row(int(at[0] if len(at) else self.match_rows[0]), by_user=True)
        self._status()

    def _search_status(self) -> str:
        if self.searching is not None:
            return f"search /{self.search_query.text}/ {self.searching}%…"
        rows = self.match_rows
        total = len(rows)
        at = int(np.searchsorted(rows, self.log_view.cursor))
        here = f"{at + 1:,}/" if at < total and int(rows[at]) == self.log_view.cursor else ""
        return f"search /{self.search_query.text}/: {here}{total:,} match{'es' if total != 1 else ''}"

    @work(thread=True, exclusive=True, group="filter", exit_on_error=False)
    def _filter_worker(self, view: View, query: Query, keep_gid: int | None) -> None:
        worker = get_current_worker()
        gids = matching_gids(self.store.snapshot(), view, query, None, lambda: worker.is_cancelled, self.search_cache)
        if gids is not None and not worker.is_cancelled:
            filtered = view.subset(f"{view.title} · filter /{query.text}/", gids)
            self.call_from_thread(self._install_filter, filtered, query, keep_gid)

    @while_shown
    def _install_filter(self, view: View, query: Query, keep_gid: int | None) -> None:
        if query is self.filter:
            self._show_view(view, keep_gid)

    # --- keys: follow, explain, export ---------------------------------------------------------
    def action_follow(self) -> None:
        self.following = not self.following
        if self.following and self.view_mode is not Mode.SPLIT:
            self.log_view.action_edge(1)
        self.notify("tail on: following the file" if self.following else "tail off", timeout=2)
        self._status()

    def action_explain(self) -> None:
        t = self.triaged
        if t is None:
            return
        rule = None
        panel = self.query_one("#findings", FindingsPanel)
        if panel.has_focus and panel.current() is not None:
            rule = panel.current().rule
        elif self.view_mode is not Mode.SPLIT:
            rule = t.rules.get(self.log_view.cursor_gid())
        if rule is None and t.run.diagnosis.root is not None:
            rule = t.run.diagnosis.root.rule
        if rule is None:
            self.notify("no finding here, and no root cause", timeout=3)
            return
        self.push_screen(RuleScreen(rule))

    def action_export(self) -> None:
        if self.triaged is None:
            self.notify("the report is not ready yet", timeout=3)
            return
        stem = Path(self.inputs.names[0]).name.split(".")[0] or "run"
        if stem.startswith("<"):
            stem = "stdin"
        self.default_export = f"{stem}.triage.md"
        self.query_one("#prompt", PromptBar).ask("export", "export Markdown to", f"{self.default_export} (enter)")

    def _export(self, path: str) -> None:
        path = path.strip() or self.default_export
        try:
            target = export_markdown(self.triaged.run.report, path, self.inputs.renames)
        except TriageError as exc:
            self.notify(str(exc), title="export failed", severity="error", markup=False)
            return
        self.exported = target
        self.notify(f"report written to {target}", title="export", markup=False, timeout=4)
