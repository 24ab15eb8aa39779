"""A log line as the viewer shows it.

Log text is untrusted. It reaches the screen only as plain text (a `rich.text.Text` built from
the string, never markup, never `Text.from_ansi`), after this module made every control
character visible: `\\x1b]0;title\\x07` is shown as those characters and changes no window
title; `[bold]` is shown as `[bold]`. Colour escapes (SGR, `\\x1b[...m`) are the one exception:
they only style text, so they are dropped, as `triage` itself drops them before matching.
A progress bar's `\\r` redraws show their final state, like a terminal would.
"""

from __future__ import annotations

import re

from logtriage.demux.clean import clean, decode
from logtriage.demux.prefixes import Dialect, strip_prefixes
from logtriage.report.safe import terminal_safe

MAX_DISPLAY_CHARS = 4000
_SGR = re.compile(r"\x1b\[[0-9;:]*m")


def display_text(raw: bytes, dialect: Dialect, strip: bool = True) -> str:
    """The line to draw: decoded, final redraw, colours dropped, launcher prefixes stripped
    (`[default0]:[rank1]: ` and the like), controls made visible, tabs expanded, shortened."""
    text = decode(raw)
    if "\r" in text:
        text = last_redraw(text)
    if "\x1b" in text:
        text = _SGR.sub("", text)
    if strip:
        text = strip_prefixes(text, dialect).text
    if "\t" in text:
        text = text.expandtabs(8)
    if len(text) > MAX_DISPLAY_CHARS:
        text = text[:MAX_DISPLAY_CHARS] + f" … [{len(text) - MAX_DISPLAY_CHARS} more characters]"
    return terminal_safe(text)


def last_redraw(text: str) -> str:
    """`a\\rb\\rc` -> `c`: what a terminal shows after the carriage returns (CRLF ends dropped)."""
    text = text.rstrip("\r")
    if "\r" not in text:
        return text
    parts = [part for part in text.split("\r") if part.strip()]
    return parts[-1] if parts else ""


def head_dialect(lines: list[bytes]) -> Dialect:
    """The prefix conventions of a source, judged from its first lines as the scan judges them."""
    return Dialect.detect(clean(decode(raw)) for raw in lines)
