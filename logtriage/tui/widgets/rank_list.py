"""The rank list: every stream of the run (ranks, launcher, banner, probes, unattributed) with
its status, line count and last step; the root-cause rows marked.

| Key | Action |
| --- | --- |
| up / down / pgup / pgdn | highlight a stream: the log view shows it |
| enter | the same, and focus the log view |
"""

from __future__ import annotations

from rich.text import Text
from textual.message import Message
from textual.widgets import DataTable

from logtriage.tui.model.streams import Status, StreamRow

ROOT_MARK = "◆"
COLUMNS = ((" ", 1), ("stream", 12), ("status", 10), ("lines", 8), ("step", 7))
STATUS_STYLE = {
    Status.ROOT_CAUSE: "bold white on red",
    Status.FAILED: "red",
    Status.CASCADE: "dark_orange",
    Status.KILLED: "magenta",
    Status.HUNG: "yellow",
    Status.OK: "green",
    Status.UNKNOWN: "dim",
}


class RankList(DataTable):
    DEFAULT_CSS = """
    RankList {
        width: 52;
        height: 1fr;
        border: round $panel-lighten-2;
        border-title-color: $text;
        &:focus { border: round $accent; }
    }
    """

    class Chosen(Message):
        """The user highlighted a stream (`activated`: with enter or a second click)."""

        def __init__(self, stream: int, activated: bool) -> None:
            self.stream = stream
            self.activated = activated
            super().__init__()

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=False)
        self.streams: tuple[StreamRow, ...] = ()
        self._last: int | None = None

    def on_mount(self) -> None:
        # Fixed widths: auto widths are measured when the table is idle, so the first frames
        # (and snapshots) would depend on timing.
        for label, width in COLUMNS:
            self.add_column(label, width=width)
        self.border_title = "streams"

    def show(self, rows: tuple[StreamRow, ...]) -> None:
        self.clear()
        self.streams = rows
        for index, row in enumerate(rows):
            marked = row.status is Status.ROOT_CAUSE
            self.add_row(
                Text(ROOT_MARK if marked else " ", style="bold red"),
                Text(row.label, style="bold" if marked else ""),
                Text(row.status.value, style=STATUS_STYLE[row.status]),
                Text(f"{row.lines:,}", justify="right"),
                Text("" if row.last_step is None else str(row.last_step), justify="right"),
                key=str(index))
        self.border_title = f"streams ({len(rows)})"

    def select(self, stream: int) -> None:
        """Highlight a stream without telling the app (it chose it)."""
        self._last = stream
        if 0 <= stream < self.row_count:
            self.move_cursor(row=stream, animate=False)

    # Only the user's moves choose a stream: highlights also follow clear() and select().
    def _moved(self) -> None:
        if self.row_count and self.cursor_row != self._last:
            self._last = self.cursor_row
            self.post_message(self.Chosen(self.cursor_row, False))

    def action_cursor_up(self) -> None:
        super().action_cursor_up()
        self._moved()

    def action_cursor_down(self) -> None:
        super().action_cursor_down()
        self._moved()

    def action_page_up(self) -> None:
        super().action_page_up()
        self._moved()

    def action_page_down(self) -> None:
        super().action_page_down()
        self._moved()

    def action_scroll_top(self) -> None:
        super().action_scroll_top()
        self._moved()

    def action_scroll_bottom(self) -> None:
        super().action_scroll_bottom()
        self._moved()

    async def _on_click(self, event) -> None:
        await super()._on_click(event)
        self._moved()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        if event.row_key is not None and event.row_key.value is not None:
            self._last = int(event.row_key.value)
            self.post_message(self.Chosen(self._last, True))
