"""Log text is untrusted: it must never drive the terminal or break the document it lands in."""

from __future__ import annotations

import html
import re

# C0/C1 controls (ESC, BEL, CR...), DEL, and Unicode bidi overrides that reorder displayed text.
_UNSAFE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def terminal_safe(text: str) -> str:
    """Control characters shown as visible escapes (`\\x1b`), never passed through."""
    return _UNSAFE.sub(lambda m: m.group(0).encode("unicode_escape").decode("ascii"), text)


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
