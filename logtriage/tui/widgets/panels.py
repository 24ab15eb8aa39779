"""The one-line panels: the verdict header, the status line, and the prompt for a search,
a filter or an export path. Text from the log reaches them as `Text`, never as markup."""

from __future__ import annotations

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Input, Label, Static

from logtriage.report.model import Report
from logtriage.report.safe import terminal_safe
from logtriage.rank_ranges import ranges

VERDICT_STYLE = {"failed": "bold white on red", "hung": "bold black on yellow", "ok": "bold black on green"}


class VerdictLine(Static):
    """Verdict and root cause in one line."""

    DEFAULT_CSS = """
    VerdictLine { height: 1; background: $panel; color: $text; padding: 0 1; }
    """

    def waiting(self, names: list[str], what: str) -> None:
        shown = names[0] + (f" +{len(names) - 1}" if len(names) > 1 else "")
        self.update(Text.assemble((" triage ", "bold reverse"), " ", (shown, "bold"), "  ", (what, "italic")))

    def show_report(self, report: Report, where: str | None) -> None:
        rc = report.root_cause
        parts: list = [(f" {report.verdict.upper()} ", VERDICT_STYLE.get(report.verdict, "bold reverse")), " "]
        if rc is None:
            parts.append(f"no failure found in {report.input_lines:,} lines")
        else:
            who = (f"ranks {ranges(rc.ranks)}" if len(rc.ranks) > 1 else
                   f"rank {rc.rank}" if rc.rank is not None else "launcher")
            parts += [(who, "bold"), ": ", (rc.title, "bold"), "  ", (rc.rule_id, "cyan")]
            if rc.exception_type:
                parts += ["  ", (terminal_safe(rc.exception_type), "yellow")]
            if where:
                parts += ["  at ", (terminal_safe(where), "underline")]
        self.update(Text.assemble(*parts, no_wrap=True, overflow="ellipsis"))


class StatusBar(Static):
    DEFAULT_CSS = """
    StatusBar { height: 1; background: $panel-darken-1; color: $text-muted; padding: 0 1; }
    """

    def show_parts(self, parts: list[str]) -> None:
        self.update(Text("  ·  ".join(terminal_safe(p) for p in parts if p), no_wrap=True, overflow="ellipsis"))


class PromptBar(Horizontal):
    """A one-line question at the bottom: enter answers (an empty line is an answer too),
    escape cancels.

    | Key | Action |
    | --- | --- |
    | enter | answer |
    | escape | cancel |
    """

    DEFAULT_CSS = """
    PromptBar { height: 1; display: none; background: $boost; }
    PromptBar > Label { width: auto; padding: 0 1; color: $accent; text-style: bold; }
    PromptBar > Input, PromptBar > Input:focus { width: 1fr; height: 1; border: none; padding: 0 1; }
    """
    BINDINGS = [Binding("escape", "cancel", "cancel")]

    class Answered(Message):
        """`value` is None when the prompt was cancelled."""

        def __init__(self, purpose: str, value: str | None) -> None:
            self.purpose = purpose
            self.value = value
            super().__init__()

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.purpose = ""

    def compose(self) -> ComposeResult:
        yield Label("")
        yield Input()

    def ask(self, purpose: str, question: str, hint: str = "") -> None:
        """Open empty (typing never appends to an old answer); `hint` shows what enter on an
        empty line means."""
        self.purpose = purpose
        self.query_one(Label).update(Text(question))
        field = self.query_one(Input)
        field.value = ""
        field.placeholder = hint
        self.display = True                 # an inline style: visible (and focusable) at once,
        self.screen.set_focus(field)        # so keys typed right after the prompt key land in it

    @property
    def is_open(self) -> bool:
        return bool(self.display)

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.display = False
        self.post_message(self.Answered(self.purpose, event.value))

    def action_cancel(self) -> None:
        self.display = False
        self.post_message(self.Answered(self.purpose, None))
