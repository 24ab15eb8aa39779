"""The log view: the lines of the current view (a stream, every line, a filter), read from the
files as they scroll into sight.

Lines are untrusted text: each becomes `Text(line)` after `model.text.display_text` made its
control characters visible, never markup. Findings are highlighted by their part in the causal
chain (initiating, cascade, teardown, context), search matches are highlighted, and in the
merged view a coloured gutter names each line's stream. Keys: see `LineCanvas`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from rich.text import Text
from textual.strip import Strip

from logtriage.tui.model.lines import LineStore
from logtriage.tui.model.search import Query
from logtriage.tui.model.streams import Mark
from logtriage.tui.model.views import View
from logtriage.tui.widgets.canvas import LineCanvas

CACHE_ROWS = 600
LABEL_WIDTH = 5
CURSOR = "▶"


class LogView(LineCanvas):
    DEFAULT_CSS = """
    LogView {
        border: round $panel-lighten-2;
        border-title-color: $text;
        border-subtitle-color: $text-muted;
        background: $surface;
        scrollbar-gutter: stable;
        &:focus { border: round $accent; }
        & > .logview--gutter { color: $text-muted; }
        & > .logview--cursor { background: $accent 35%; }
        & > .logview--initiating { background: $error 55%; color: $text; text-style: bold; }
        & > .logview--cascade { background: $warning 25%; }
        & > .logview--teardown { color: $text-muted; text-style: italic; }
        & > .logview--context { color: $primary-lighten-2; }
        & > .logview--match { background: $secondary; color: $text; text-style: bold reverse; }
    }
    """
    COMPONENT_CLASSES = {"logview--gutter", "logview--cursor", "logview--initiating", "logview--cascade",
                         "logview--teardown", "logview--context", "logview--match"}

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.store: LineStore | None = None
        self.view = View.every_line("", 0)
        self.marks: dict[int, Mark] = {}
        self.stream_label: Callable[[int], tuple[str, str]] | None = None   # gid -> (label, colour)
        self.search: Query | None = None
        self._digits = 4
        self._cache: OrderedDict[tuple, tuple[Strip, Strip]] = OrderedDict()

    def show(self, store: LineStore, view: View, keep_gid: int | None = None) -> None:
        """Show a view; the cursor stays on `keep_gid` when the view has it, else on its row."""
        self.store = store
        self.view = view
        self._digits = max(4, len(str(max((len(s.offsets) for s in store.sources), default=0))))
        self.redraw()
        self.reset_rows()
        row = view.row_of(keep_gid) if keep_gid is not None else None
        if row is not None:
            self.goto_row(row)
        elif self.cursor >= view.count:
            self.goto_row(max(view.count - 1, 0))

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._cache.clear()

    def redraw(self) -> None:
        """Marks, labels or the query changed."""
        self._cache.clear()
        self.refresh()

    def row_count(self) -> int:
        return self.view.count

    def cursor_gid(self) -> int | None:
        return self.view.gid(self.cursor) if 0 <= self.cursor < self.view.count else None

    def render_row(self, row: int, cursor: bool) -> tuple[Strip, Strip]:
        gid = self.view.gid(row)
        width = self.scrollable_content_region.width + self.scroll_offset.x
        key = (gid, cursor, width if cursor else 0)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        base = self.rich_style
        cursor_style = self.get_component_rich_style("logview--cursor")
        gutter = Text(f"{self.store.line_number(gid):>{self._digits}}{CURSOR if cursor else ' '}", no_wrap=True, end="")
        gutter.stylize(base + self.get_component_rich_style("logview--gutter"))
        if self.stream_label is not None:
            label, colour = self.stream_label(gid)
            gutter.append(f"{label:<{LABEL_WIDTH}.{LABEL_WIDTH}} ", style=colour)
        text = self.store.text(gid)
        body = Text(text, no_wrap=True, end="")
        if cursor:
            body.append(" " * max(0, width - body.cell_len))
        body.stylize(base)
        mark = self.marks.get(gid)
        if mark is not None:
            body.stylize(self.get_component_rich_style(f"logview--{mark.value}"), 0, len(text))
        if self.search is not None:
            match_style = self.get_component_rich_style("logview--match")
            for start, end in self.search.spans(text):
                body.stylize(match_style, start, end)
        if cursor:
            gutter.stylize(cursor_style)
            if mark is None:               # a marked line keeps its colour; the gutter shows the cursor
                body.stylize(cursor_style)
        strips = (self.strip_of(gutter, self.app.console), self.strip_of(body, self.app.console))
        self._cache[key] = strips
        if len(self._cache) > CACHE_ROWS:
            self._cache.popitem(last=False)
        return strips

    def visible_lines(self) -> list[tuple[int, str]]:
        """(line number, text) of the rows on screen: what a reader sees, for tests and tools."""
        top = self.scroll_offset.y
        rows = range(top, min(top + self.scrollable_content_region.height, self.view.count))
        return [(self.store.line_number(self.view.gid(r)), self.store.text(self.view.gid(r))) for r in rows]
