"""Byte readers of a line's shape for the fast path's kernel (kernel.py): a progress bar and a bar
with text glued after it (mirroring demux/clean.py), the part of a CR-redrawn line the terminal
finally shows, a non-ASCII byte, the word `rank`, a `[stdout]`/`[stderr]` tag, a `pid=` field, the
prefixes split.py strips before a glued rank's output, a bare `rank N ` glued onto another print (split.py), and a
progress line's step word (scan_result.STEP)."""

from __future__ import annotations

from numba import njit

from logtriage.fastscan.kernel_markers import is_rank_at
from logtriage.fastscan.kernel_prefixes import is_digit, number


@njit(cache=True, nogil=True)
def is_bar(buf, a, b):
    """clean._PROGRESS_BAR on buf[a:b]: `\\d%\\|`, `\\d(it/s|s/it)\\]` or `\\[\\d\\d:\\d\\d<`."""
    for k in range(a, b):
        ch = buf[k]
        if is_digit(ch):
            if k + 2 < b and buf[k + 1] == 37 and buf[k + 2] == 124:
                return True
            if k + 5 < b and buf[k + 5] == 93 and ((buf[k + 1] == 105 and buf[k + 2] == 116 and buf[k + 3] == 47
                                                    and buf[k + 4] == 115)
                                                   or (buf[k + 1] == 115 and buf[k + 2] == 47 and buf[k + 3] == 105
                                                       and buf[k + 4] == 116)):
                return True
        elif ch == 91 and k + 6 < b and is_digit(buf[k + 1]) and is_digit(buf[k + 2]) and buf[k + 3] == 58 \
                and is_digit(buf[k + 4]) and is_digit(buf[k + 5]) and buf[k + 6] == 60:
            return True
    return False


@njit(cache=True, nogil=True)
def bar_then_text(buf, a, b):
    """clean._BAR_THEN_TEXT on buf[a:b]: a bar's rate `[\\d?](it/s|s/it)]` with text glued after it."""
    for k in range(a, b - 6):
        ch = buf[k]
        if (is_digit(ch) or ch == 63) and buf[k + 5] == 93 and buf[k + 6] != 32 \
                and ((buf[k + 1] == 105 and buf[k + 2] == 116 and buf[k + 3] == 47 and buf[k + 4] == 115)
                     or (buf[k + 1] == 115 and buf[k + 2] == 47 and buf[k + 3] == 105 and buf[k + 4] == 116)):
            return True
    return False


@njit(cache=True, nogil=True)
def has_high(buf, a, b):
    for k in range(a, b):
        if buf[k] > 127:
            return True
    return False


@njit(cache=True, nogil=True)
def has_rank(buf, a, b):
    for k in range(a, b - 3):
        if is_rank_at(buf, k):
            return True
    return False


@njit(cache=True, nogil=True)
def is_stream_tag(buf, c, end):
    """`[stdout]` or `[stderr]` at c."""
    if end - c < 8 or buf[c + 1] != 115 or buf[c + 2] != 116 or buf[c + 3] != 100 or buf[c + 7] != 93:
        return False   # not "[std...]"
    return (buf[c + 4] == 111 and buf[c + 5] == 117 and buf[c + 6] == 116) or \
        (buf[c + 4] == 101 and buf[c + 5] == 114 and buf[c + 6] == 114)


@njit(cache=True, nogil=True)
def has_pid(buf, a, b):
    for k in range(a, b - 3):
        if buf[k] == 112 and buf[k + 1] == 105 and buf[k + 2] == 100 and buf[k + 3] == 61:   # "pid="
            return True
    return False


@njit(cache=True, nogil=True)
def redraw(buf, start, end):
    """clean._last_redraw for a line with CRs: (a, b) of the part the terminal finally shows
    (the last non-blank part; if that is a progress bar, the last part that is not), or (-1, -1)
    when no part is left."""
    last_a = -1
    last_b = -1
    b = end
    k = end - 1
    while k >= start - 1:
        if k < start or buf[k] == 13:
            a = k + 1
            blank = True
            for q in range(a, b):
                if buf[q] != 32:
                    blank = False
                    break
            if not blank:
                if last_a < 0:
                    last_a = a
                    last_b = b
                    if not is_bar(buf, a, b):
                        return a, b
                elif not is_bar(buf, a, b):
                    return a, b
            b = k
        k -= 1
    return last_a, last_b


@njit(cache=True, nogil=True)
def _bare_marker_at(buf, k, end):
    """split.py's `rank \\d{1,6}[ :/]` at k."""
    if k + 5 >= end or not (buf[k] == 114 and buf[k + 1] == 97 and buf[k + 2] == 110 and buf[k + 3] == 107
                            and buf[k + 4] == 32):
        return False
    _, digits, j = number(buf, k + 5, end, 6)
    return 0 < digits <= 6 and j < end and (buf[j] == 32 or buf[j] == 58 or buf[j] == 47)


@njit(cache=True, nogil=True)
def bare_glued(buf, c, end):
    """A line that starts with a script's bare `rank N ` and holds another glued straight onto the end of a print
    (after a digit, `.`, `)`, `]` or `%`): split.py cuts it there, so the exact path takes the line."""
    if not _bare_marker_at(buf, c, end):
        return False
    for k in range(c + 1, end - 5):
        p = buf[k - 1]
        if (is_digit(p) or p == 46 or p == 41 or p == 93 or p == 37) and _bare_marker_at(buf, k, end):
            return True
    return False


@njit(cache=True, nogil=True)
def leading(buf, i, end):
    """End of split.py's _LEADING: `(\\d{1,7}: )?(\\[[^\\[\\]]{1,120}\\](:|(?=\\[))? ?)*`."""
    k = i
    d = 0
    while k < end and is_digit(buf[k]) and d < 8:
        k += 1
        d += 1
    if 0 < d <= 7 and k + 1 < end and buf[k] == 58 and buf[k + 1] == 32:
        i = k + 2
    k = i
    while k < end and buf[k] == 91:
        j = k + 1
        while j < end and j - k <= 121 and buf[j] != 93 and buf[j] != 91:
            j += 1
        if j >= end or buf[j] != 93 or j == k + 1 or j - k > 121:
            break
        j += 1
        if j < end and buf[j] == 58:
            j += 1
        if j < end and buf[j] == 32:
            j += 1
        k = j
    return k


@njit(cache=True, nogil=True)
def _is_word_byte(c):
    return 48 <= c <= 57 or 65 <= c <= 90 or 97 <= c <= 122 or c == 95


@njit(cache=True, nogil=True, inline="always")
def is_step_at(buf, k, size):
    """Whether the `t` at k starts "tep"/"ter" (step, iter, iteration), or ends a word "it" that a
    counter follows (`it 3/7`, `it=3`)."""
    if k + 2 >= size:
        return False
    if buf[k + 1] == 101 and (buf[k + 2] == 112 or buf[k + 2] == 114):
        return True
    return ((buf[k + 1] == 32 or buf[k + 1] == 61) and is_digit(buf[k + 2]) and k >= 1 and buf[k - 1] == 105
            and (k < 2 or not _is_word_byte(buf[k - 2])))
