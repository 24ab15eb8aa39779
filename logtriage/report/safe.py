"""Log text is untrusted: it must never drive the terminal or break the document it lands in."""

from __future__ import annotations

import html
import re

# C0/C1 controls (ESC, BEL, CR...), DEL, and Unicode bidi overrides that reorder displayed text.
_UNSAFE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def terminal_safe(text: str) -> str:
    """Control characters shown as visible escapes (`\\x1b`), never passed through."""
    return _UNSAFE.sub(lambda m: m.group(0).encode("unicode_escape").decode("ascii"), text)


# Our own colour codes (report/text.py Style): SGR only, digits and semicolons.
_OWN_SGR = re.compile(r"(\x1b\[[0-9;]*m)")


def terminal_safe_document(document: str, keep_colour: bool = False) -> str:
    """A whole rendered document made terminal-safe line by line, whatever slipped into it (a file
    name, a rule's title); with keep_colour, SGR colour codes (ours) survive and nothing else."""
    lines = document.split("\n")
    if not keep_colour:
        return "\n".join(terminal_safe(line) for line in lines)
    return "\n".join("".join(piece if _OWN_SGR.fullmatch(piece) else terminal_safe(piece)
                             for piece in _OWN_SGR.split(line)) for line in lines)


def markdown_code_span(text: str) -> str:
    """Text as an inline code span inside a table cell: nothing inside is markup, so no
    backslash escapes, except `|`, which GFM tables split on even inside code."""
    text = terminal_safe(text).replace("|", "\\|")
    longest = max((len(m.group(0)) for m in re.finditer(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def markdown_inline(text: str) -> str:
    """Text for a Markdown table cell or paragraph: no HTML, no table breaks, no stray markup."""
    text = terminal_safe(text)
    text = html.escape(text, quote=False)
    return re.sub(r"([\\`*_{}\[\]()#+!|~>])", r"\\\1", text)


def markdown_code_block(lines: list[str]) -> str:
    """A fenced block whose fence is longer than any backtick run inside."""
    body = "\n".join(terminal_safe(line) for line in lines)
    longest = max((len(m.group(0)) for m in re.finditer(r"`+", body)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{body}\n{fence}"
