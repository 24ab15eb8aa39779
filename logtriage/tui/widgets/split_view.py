"""Two streams side by side, row by row as `model.align` paired them (same step, else time,
else input order). Each half shows line numbers and the untrusted line as plain text.
Keys: see `LineCanvas`."""

from __future__ import annotations

import numpy as np
from rich.text import Text
from textual.strip import Strip

from logtriage.tui.model.align import BLANK, SplitRows
from logtriage.tui.model.lines import LineStore
from logtriage.tui.model.streams import Mark
from logtriage.tui.widgets.canvas import LineCanvas


class SplitView(LineCanvas):
    DEFAULT_CSS = """
    SplitView {
        border: round $panel-lighten-2;
        border-title-color: $text;
        border-subtitle-color: $text-muted;
        background: $surface;
        scrollbar-gutter: stable;
        overflow-x: hidden;
        &:focus { border: round $accent; }
        & > .splitview--gutter { color: $text-muted; }
        & > .splitview--divider { color: $panel-lighten-2; }
        & > .splitview--cursor { background: $accent 35%; }
        & > .splitview--initiating { background: $error 55%; color: $text; text-style: bold; }
        & > .splitview--cascade { background: $warning 25%; }
        & > .splitview--teardown { color: $text-muted; text-style: italic; }
        & > .splitview--context { color: $primary-lighten-2; }
    }
    """
    COMPONENT_CLASSES = {"splitview--gutter", "splitview--divider", "splitview--cursor", "splitview--initiating",
                         "splitview--cascade", "splitview--teardown", "splitview--context"}

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.store: LineStore | None = None
        self.rows = SplitRows(np.empty(0, np.int64), np.empty(0, np.int64), None)
        self.marks: dict[int, Mark] = {}
        self.streams: tuple[int, int] | None = None

    def show(self, store: LineStore, rows: SplitRows, streams: tuple[int, int], marks: dict[int, Mark]) -> None:
        self.store, self.rows, self.streams, self.marks = store, rows, streams, marks
        self.cursor = 0
        self.reset_rows()
        self.scroll_to(y=0, animate=False)

    def row_count(self) -> int:
        return len(self.rows.left)

    def row_of(self, gid: int) -> int | None:
        for side in (self.rows.left, self.rows.right):
            hits = np.flatnonzero(side == gid)
            if len(hits):
                return int(hits[0])
        return None

    def render_row(self, row: int, cursor: bool) -> tuple[Strip, Strip]:
        width = self.scrollable_content_region.width
        half = max((width - 1) // 2, 1)
        left = self._half(int(self.rows.left[row]), half)
        right = self._half(int(self.rows.right[row]), width - half - 1)
        line = Text.assemble(left, Text("│", style=self.get_component_rich_style("splitview--divider")), right,
                             no_wrap=True, end="")
        line.stylize(self.rich_style)
        line.spans.insert(0, line.spans.pop())      # the base style under every other style
        if cursor:
            line.stylize(self.get_component_rich_style("splitview--cursor"))
        return Strip([]), self.strip_of(line, self.app.console)

    def _half(self, gid: int, width: int) -> Text:
        if gid == BLANK or self.store is None:
            return Text(" " * width)
        digits = 6
        gutter = Text(f"{self.store.line_number(gid):>{digits}} ")
        gutter.stylize(self.get_component_rich_style("splitview--gutter"))
        body = Text(self.store.text(gid))
        mark = self.marks.get(gid)
        if mark is not None:
            body.stylize(self.get_component_rich_style(f"splitview--{mark.value}"))
        half = Text.assemble(gutter, body, no_wrap=True, end="")
        half.truncate(width, overflow="crop", pad=True)
        return half
