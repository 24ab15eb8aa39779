"""Turn a raw byte line into text a rule can match: decoded, escape sequences and control
characters removed, tqdm `\\r` redraws reduced to the last state, CRLF ends dropped."""

from __future__ import annotations

import re

# CSI (colours, cursor moves), OSC (titles, hyperlinks; BEL or ST terminated), other 2-byte escapes.
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]|\x9b[0-?]*[ -/]*[@-~]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def decode(raw: bytes) -> str:
    """UTF-8, falling back per line to Latin-1 for legacy bytes (every byte maps to a character,
    so nothing is lost); NUL bytes survive decoding and are removed by clean()."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace") if _mostly_utf8(raw) else raw.decode("latin-1")


def _mostly_utf8(raw: bytes) -> bool:
    bad = raw.decode("utf-8", errors="replace").count("\ufffd")
    return bad * 20 < max(1, len(raw))


def clean(text: str) -> str:
    """The line as a terminal would finally show it, without styling."""
    if "\r" in text:
        text = _last_redraw(text)
    if "\x1b" in text or "\x9b" in text:
        text = _ESCAPES.sub("", text)
    if _CONTROL.search(text):
        text = _CONTROL.sub("", text)
    return text


def _last_redraw(text: str) -> str:
    text = text.rstrip("\r")
    if "\r" not in text:
        return text
    parts = [p for p in text.split("\r") if p.strip()]
    return parts[-1] if parts else ""
