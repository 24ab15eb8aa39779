"""Turn a raw byte line into text a rule can match: decoded, escape sequences and control
characters removed, tqdm `\\r` redraws reduced to the last state, CRLF ends dropped."""

from __future__ import annotations

import codecs
import re

# CSI (colours, cursor moves), OSC (titles, hyperlinks; BEL or ST terminated), other 2-byte escapes.
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]|\x9b[0-?]*[ -/]*[@-~]")
# C0 and C1 controls left after the escapes are gone (C1: a stray 0x9b CSI read as Latin-1
# would otherwise hide the `Traceback` after it), so cleaning twice changes nothing.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# tqdm and friends: `45%|####5     | 45/100 [00:01<00:01, 30.2it/s]`
_PROGRESS_BAR = re.compile(r"\d%\||\d(?:it/s|s/it)\]|\[\d\d:\d\d<")
# a bar's rate with another process's message glued after it (no newline between them):
# `rank 0:  50%|#####     | 3/6 [00:03<00:03,  1.01s/it][FATAL] ...`
_LABEL_ONLY = re.compile(r"^(?:[\w.@-]{1,64}: ?|\[[^\[\]\s]{1,64}\]: ?|\d{1,6}: ?)$")
_BAR_THEN_TEXT = re.compile(r"[\d?](?:it/s|s/it)\](?=\S)")
# Unicode blanks a paste or a web page puts where the program printed spaces (a no-break space in
# an issue's copied traceback, a figure or thin space), and zero-width marks (a byte-order mark
# before the first line); typographic quotes that a chat or word processor made of `"` and `'`
_BLANKS = {**{c: " " for c in (0xA0, 0x1680, 0x2007, 0x202F, 0x205F, 0x3000, *range(0x2000, 0x200B))},
           0x200B: None, 0x2060: None, 0xFEFF: None,
           0x201C: '"', 0x201D: '"', 0x2018: "'", 0x2019: "'"}


def _latin1_bytes(exc: UnicodeDecodeError) -> tuple[str, int]:
    return exc.object[exc.start:exc.end].decode("latin-1"), exc.end


codecs.register_error("logtriage-latin1", _latin1_bytes)
_EXACT_UP_TO = 4096   # longer lines of mostly binary skip the byte-by-byte fallback (slow there)


def decode(raw: bytes) -> str:
    """UTF-8; bytes that are not UTF-8 are read as Latin-1 (every byte maps to a character, so
    nothing is lost): byte by byte, so a Latin-1 `café` next to UTF-8 `ü` keeps both, except in
    a long line of mostly binary, which is read as Latin-1 whole (fast). NUL bytes survive
    decoding and are removed by clean()."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        if len(raw) > _EXACT_UP_TO and not _mostly_utf8(raw):
            return raw.decode("latin-1")
        return raw.decode("utf-8", errors="logtriage-latin1")


def _mostly_utf8(raw: bytes) -> bool:
    bad = raw.decode("utf-8", errors="replace").count("\ufffd")
    return bad * 20 < max(1, len(raw))


def clean(text: str) -> str:
    """The line as a terminal would finally show it, without styling (Unicode blanks as spaces,
    typographic quotes as the ASCII ones)."""
    if not text.isascii():
        text = text.translate(_BLANKS)
    if "\r" in text:
        text = _last_redraw(text)
    if "\x1b" in text or "\x9b" in text:
        text = _ESCAPES.sub("", text)
    if _CONTROL.search(text):
        text = _CONTROL.sub("", text)
    return text


def _last_redraw(text: str) -> str:
    """The last state of a `\\r`-redrawn line; but when a progress bar redraws over text that is
    not a bar (an unbuffered rank's message whose newline came after another rank's bar), the
    text is kept, not the bar: `ValueError: bad batch\\r 55%|#####| 55/100` gives the error."""
    text = text.rstrip("\r")
    if "\r" not in text:
        return text
    parts = [p for p in text.split("\r") if p.strip()]
    if not parts:
        return ""
    # a launcher's label written before the first redraw (`worker-0: \r 17%|...`) is the line's own
    label = parts[0] if len(parts) > 1 and _LABEL_ONLY.match(parts[0]) else ""
    body = parts[1:] if label else parts
    if _PROGRESS_BAR.search(body[-1]):
        glued = after_bar(body[-1])
        if glued != body[-1]:
            return label + glued      # the bar's last state, then a record written after it
        for part in reversed(body):
            if not _PROGRESS_BAR.search(part):
                return label + part
    return label + after_bar(body[-1])


def after_bar(part: str) -> str:
    """The redrawn bar's last state with a message glued after it: the message is what the line
    carries (the bar's own state is redrawn again a moment later). Also for lines without a `\\r`:
    a reader in text mode (torchrun's `--tee`) ends lines at each `\\r`, so the bar's last state
    and the message written after it arrive as one line behind the stream's prefix."""
    m = _BAR_THEN_TEXT.search(part)
    return part[m.end():] if m else part


# CPython 3.11+ prints an exception group inside a margin: `  + Exception Group Traceback (most
# recent call last):`, `  | ` before each of its lines, `  +-+---- 1 ----` between sub-exceptions
# (deeper for nested groups). Without the margin it reads as a traceback with more after it.
_GROUP_HEAD = re.compile(r"^\s*[+|] (?:\| )*Exception Group Traceback \(most recent call last\):\s*$")
_GROUP_RULE = re.compile(r"^\s*(?:\| )*\+(?:-\+)?-{4,}(?: (?:\d+|\.\.\.[^-]*) -+)?\s*$")
_GROUP_MARGIN = re.compile(r"^\s*(?:\| )+")
# what may follow the margin: a traceback's own grammar (a table drawn with `|` stays as it is)
_TRACEBACK_GRAMMAR = re.compile(
    r"Traceback \(most recent call last\):|\s{2,}\S|[A-Za-z_][\w.]*(?:Error|Exception|Group|Interrupt|Exit|Warning)"
    r"(?::|\s*$)|\s*$")
GROUP_TRACEBACK_START = "Traceback (most recent call last):"


def ungrouped(text: str) -> str:
    """An exception group's line without its margin (the header as a traceback's start, a
    separator as a blank line); any other line as it is."""
    if _GROUP_HEAD.match(text):
        return GROUP_TRACEBACK_START
    if _GROUP_RULE.match(text):
        return ""
    margin = _GROUP_MARGIN.match(text)
    if margin and _TRACEBACK_GRAMMAR.match(text, margin.end()):
        return text[margin.end():]
    return text
