"""A scrolling list of rows drawn line by line (Textual's line API), with a cursor row.

Subclasses say how many rows there are and draw one row; nothing is drawn that is not on
screen, so the row count can be ten million.

| Key | Action |
| --- | --- |
| up / down | move the cursor one row |
| pageup / pagedown | move the cursor one screen |
| home / end | first / last row |
| left / right | scroll long lines sideways |
"""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip


class LineCanvas(ScrollView, can_focus=True):
    BINDINGS = [
        Binding("up", "move(-1)", "up", show=False),
        Binding("down", "move(1)", "down", show=False),
        Binding("pageup", "page(-1)", "page up", show=False),
        Binding("pagedown", "page(1)", "page down", show=False),
        Binding("home", "edge(0)", "first", show=False),
        Binding("end", "edge(1)", "last", show=False),
        Binding("left", "sideways(-8)", "left", show=False),
        Binding("right", "sideways(8)", "right", show=False),
    ]

    class CursorMoved(Message):
        """The cursor moved to another row (by a key or a click)."""

        def __init__(self, canvas: "LineCanvas", row: int, by_user: bool) -> None:
            self.canvas = canvas
            self.row = row
            self.by_user = by_user
            super().__init__()

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.cursor = 0
        self._widest = 0

    # --- what subclasses provide -------------------------------------------------------
    def row_count(self) -> int:
        raise NotImplementedError

    def render_row(self, row: int, cursor: bool) -> tuple[Strip, Strip]:
        """(fixed part, scrolling part) of one row: the gutter stays put when scrolling sideways."""
        raise NotImplementedError

    # --- drawing ---------------------------------------------------------------------------
    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        row = scroll_y + y
        width = self.scrollable_content_region.width
        if row >= self.row_count():
            return Strip.blank(width, self.rich_style)
        fixed, body = self.render_row(row, row == self.cursor)
        if body.cell_length > self._widest:
            self._widest = body.cell_length
            self.call_later(self._resize)
        room = max(width - fixed.cell_length, 0)
        return Strip.join([fixed, body.crop_extend(scroll_x, scroll_x + room, self.rich_style)])

    def _resize(self) -> None:
        self.virtual_size = Size(self._widest + 12, self.row_count())

    def reset_rows(self) -> None:
        """The rows changed: new height, redraw."""
        self.virtual_size = Size(self._widest + 12, self.row_count())
        self.cursor = min(self.cursor, max(self.row_count() - 1, 0))
        self.refresh()

    @staticmethod
    def strip_of(text: Text, console) -> Strip:
        segments = [s for s in text.render(console) if s.text != "\n"]
        return Strip(segments)

    @staticmethod
    def pad(width: int, style: Style | None = None) -> Strip:
        return Strip([Segment(" " * width, style)], width)

    # --- the cursor ----------------------------------------------------------------------
    def goto_row(self, row: int, by_user: bool = False, place: float = 1 / 3) -> None:
        """Put the cursor on a row and scroll so it sits `place` of the way down the screen."""
        count = self.row_count()
        if count == 0:
            return
        self.cursor = max(0, min(row, count - 1))
        self.post_message(self.CursorMoved(self, self.cursor, by_user))
        self.refresh()
        self.call_after_refresh(self._place, place)
        self._place(place)

    def _place(self, place: float) -> None:
        height = self.scrollable_content_region.height
        top = self.scroll_offset.y
        if place < 0:                     # only as far as needed to keep it visible
            if self.cursor < top:
                self.scroll_to(y=self.cursor, animate=False, immediate=True)
            elif height and self.cursor >= top + height:
                self.scroll_to(y=self.cursor - height + 1, animate=False, immediate=True)
            return
        self.scroll_to(y=max(0, self.cursor - int(height * place)), animate=False, immediate=True)

    def row_visible(self, row: int) -> bool:
        top = self.scroll_offset.y
        return top <= row < top + self.scrollable_content_region.height

    def action_move(self, delta: int) -> None:
        self._step(self.cursor + delta)

    def action_page(self, direction: int) -> None:
        self._step(self.cursor + direction * max(self.scrollable_content_region.height - 1, 1))

    def action_edge(self, end: int) -> None:
        self._step(self.row_count() - 1 if end else 0)

    def action_sideways(self, delta: int) -> None:
        self.scroll_to(x=max(0, self.scroll_offset.x + delta), animate=False)

    def _step(self, row: int) -> None:
        count = self.row_count()
        if count == 0:
            return
        self.cursor = max(0, min(row, count - 1))
        self.post_message(self.CursorMoved(self, self.cursor, True))
        self.refresh()
        self._place(-1)

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None:
            return
        row = self.scroll_offset.y + offset.y
        if 0 <= row < self.row_count():
            self.cursor = row
            self.post_message(self.CursorMoved(self, row, True))
            self.refresh()
