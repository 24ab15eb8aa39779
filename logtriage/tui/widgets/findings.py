"""The findings panel: the causal chain (numbered: initiating, cascade, teardown), then every
finding once per rule and rank, in input order. Finding text comes from the log: it is shown
as plain `Text`, never as markup.

| Key | Action |
| --- | --- |
| up / down | highlight a finding |
| enter | jump to its line in the log view |
| ? | its rule: explanation, fix, misdiagnosis (an app key) |
"""

from __future__ import annotations

from rich.text import Text
from textual.message import Message
from textual.widgets import DataTable

from logtriage.report.safe import terminal_safe
from logtriage.rank_ranges import ranges
from logtriage.tui.model.streams import FindingRow, Mark

MARK_STYLE = {
    Mark.INITIATING: "bold white on red",
    Mark.CASCADE: "dark_orange",
    Mark.TEARDOWN: "dim italic",
    Mark.CONTEXT: "cyan",
}
TEXT_WIDTH = 160
COLUMNS = (("#", 2), ("role", 10), ("ranks", 8), ("rule", 28), ("line", 7), ("text", TEXT_WIDTH))


class FindingsPanel(DataTable):
    DEFAULT_CSS = """
    FindingsPanel {
        height: 11;
        border: round $panel-lighten-2;
        border-title-color: $text;
        &:focus { border: round $accent; }
    }
    """

    class Chosen(Message):
        """Enter on a finding: jump to its line."""

        def __init__(self, finding: FindingRow) -> None:
            self.finding = finding
            super().__init__()

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row")
        self.findings: tuple[FindingRow, ...] = ()

    def on_mount(self) -> None:
        for label, width in COLUMNS:            # fixed: see RankList
            self.add_column(label, width=width)
        self.border_title = "findings"

    def show(self, findings: tuple[FindingRow, ...], line_number) -> None:
        """`line_number(gid)`: the 1-based line within its file, as the report cites it."""
        self.clear()
        self.findings = findings
        chain = sum(1 for f in findings if f.in_chain)
        for index, finding in enumerate(findings):
            number = str(index + 1) if finding.in_chain else ""
            count = f" ×{finding.count}" if finding.count > 1 else ""
            self.add_row(
                Text(number, justify="right"),
                Text(finding.mark.value, style=MARK_STYLE[finding.mark]),
                Text(ranges(finding.ranks) if finding.ranks else "—"),
                Text(finding.rule.id + count),
                Text(str(line_number(finding.gid)), justify="right"),
                Text(terminal_safe(finding.text[:TEXT_WIDTH]), no_wrap=True),
                key=str(index))
        self.border_title = f"causal chain ({chain}) · findings ({len(findings) - chain})"

    def current(self) -> FindingRow | None:
        if not self.findings or not 0 <= self.cursor_row < len(self.findings):
            return None
        return self.findings[self.cursor_row]

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        if event.row_key is not None and event.row_key.value is not None:
            self.post_message(self.Chosen(self.findings[int(event.row_key.value)]))
