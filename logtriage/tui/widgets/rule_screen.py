"""`?`: a rule's documentation over the screen: what it means, what to do, what not to conclude.

| Key | Action |
| --- | --- |
| escape / q / ? | close |
| up / down / pgup / pgdn | scroll |
"""

from __future__ import annotations

import textwrap

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from logtriage.catalog.rule import Rule

WRAP = 84


def rule_text(rule: Rule) -> Text:
    """The rule's documentation as plain text (user rules are files too: no markup)."""
    out = Text()
    out.append(f"{rule.id}\n", style="bold cyan")
    out.append(f"{rule.title}\n\n", style="bold")
    facts = [("category", rule.category.value), ("role", rule.role.value), ("severity", rule.severity.value)]
    if rule.layer is not None:
        facts.append(("layer", rule.layer.value))
    if rule.aliases:
        facts.append(("aliases", ", ".join(rule.aliases)))
    for name, value in facts:
        out.append(f"{name:<10}", style="dim")
        out.append(f"{value}\n")
    for heading, body in (("What it means", rule.explanation), ("What to do", rule.fix),
                          ("Don't conclude", rule.misdiagnosis)):
        out.append(f"\n{heading}\n", style="bold underline")
        out.append(textwrap.fill(" ".join(body.split()), WRAP) + "\n" if body.strip() else "(not documented)\n",
                   style="" if body.strip() else "dim")
    if rule.references:
        out.append("\nReferences\n", style="bold underline")
        for ref in rule.references:
            out.append(f"  {ref}\n")
    return out


class RuleScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    RuleScreen { align: center middle; }
    RuleScreen > VerticalScroll {
        width: 92; height: 80%; border: thick $accent; background: $surface; padding: 1 2;
    }
    """
    BINDINGS = [Binding("escape,q,question_mark", "close", "close")]

    def __init__(self, rule: Rule) -> None:
        super().__init__()
        self.rule = rule

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(rule_text(self.rule), id="rule-text")

    def on_mount(self) -> None:
        self.query_one(VerticalScroll).border_title = "rule"
        self.query_one(VerticalScroll).focus()

    def action_close(self) -> None:
        self.dismiss(None)
