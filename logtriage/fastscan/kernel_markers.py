"""Byte readers of the rank markers a script writes into its own lines (`[rank 3]`, `rank=3`, a
logging format's rank field), for the fast path's kernel (kernel.py). Each mirrors
line_marks.find_rank_marker or split.py's user marker."""

from __future__ import annotations

import numpy as np
from numba import njit

from logtriage.demux.line_marks import NOT_OWN_WORDS
from logtriage.fastscan.kernel_prefixes import is_digit, global_before, lower, number, skip_spaces, spaces_before

MARKER_HEAD = 120           # find_rank_marker looks at text[:120]


@njit(cache=True, nogil=True)
def bracket_is_plain(buf, c, end):
    """A message starting with `[` that no prefix rule strips: plain unless it could be a prefix
    template (`|`, `=` inside), an OpenMPI tag or a tee header (`]<`, `]:`), a `[N]:` entry."""
    k = c + 1
    all_digits = True
    while k < end and k - c <= 121:
        ch = buf[k]
        if ch == 93:
            if all_digits and k > c + 1:
                return False
            if k + 1 < end and (buf[k + 1] == 58 or buf[k + 1] == 60):
                return False
            return True
        if ch == 124 or ch == 61 or ch == 91:
            return False
        if not is_digit(ch):
            all_digits = False
        k += 1
    return True


@njit(cache=True, nogil=True)
def is_rank_at(buf, p):
    # b | 32 folds ASCII case and maps no other byte onto these letters
    return (buf[p] | 32) == 114 and (buf[p + 1] | 32) == 97 and (buf[p + 2] | 32) == 110 and (buf[p + 3] | 32) == 107


@njit(cache=True, nogil=True)
def marker(buf, c, end, found):
    """line_marks.find_rank_marker on an unprefixed message, within its first 120 characters
    (case-insensitive), trying its three patterns in order:
    1. `[ *(global[_ ]|[a-z][\\w.-]{0,31} +)?rank *[:=#]? *(\\d{1,9}) *(/ *\\d+ *)?]`
    2. `(^|[ ,(|])(global_)?rank *[=:] *(\\d{1,9})\\b`
    3. `^ *rank *(\\d{1,9})( */ *\\d+)?( *[:|\\]]| +(?!(and|or|failed|...)\\b)[a-z])` (line_marks.py's NOT_OWN_WORDS)
    (and the last ones: `(rank N)`, `> rank N` read here; `] rank N: `, `ERROR rank N: ` left to the exact path)
    Returns the rank, -1 for none, or -2 where only the exact path can tell."""
    head_end = min(end, c + MARKER_HEAD)
    count = 0   # `found` (scratch space) gets where "rank" occurs: at most 8, beyond that the exact path
    for p in range(c, head_end - 3):
        if (buf[p] | 32) == 114 and is_rank_at(buf, p):
            # pattern 1's leftmost match starts at the first "rank" that completes one (the text
            # between its `[` and "rank" cannot hold another "rank"): stop at the first success
            value = _bracket_marker_at(buf, c, p, head_end)
            if value >= 0:
                return value
            if count == 8:
                return -2
            found[count] = p
            count += 1
    for q in range(count):
        value = _assignment_marker_at(buf, c, found[q], head_end)
        if value >= 0:
            return value
    k = skip_spaces(buf, c, head_end)
    if k + 4 <= head_end and is_rank_at(buf, k):
        value, digits, k = number(buf, skip_spaces(buf, k + 4, head_end), head_end, 9)
        if 0 < digits <= 9:
            k = _past_world_size(buf, k, head_end)
            after = k
            k = skip_spaces(buf, k, head_end)
            if k < head_end and (buf[k] == 58 or buf[k] == 124 or buf[k] == 93):
                return value
            if k > after:
                hit = _own_word_at(buf, k, head_end, value)
                if hit != -1:
                    return hit
    value = _opening_marker(buf, c, head_end)
    if value == -1:
        for q in range(count):
            if _after_a_bracket(buf, c, found[q], head_end):
                return -2   # find_rank_marker's `] rank 4: ` (a logging format's level): the exact path reads it
        if _stamp_then_r(buf, c, head_end):
            return -2   # find_rank_marker's `<time> rank2 INFO `, `<epoch> r0 INFO `: the exact path reads it
    return value


@njit(cache=True, nogil=True)
def _past_world_size(buf, k, head_end):
    """Pattern 3's optional world size after the rank (`rank 1/4: `): where it ends, or `k` without one."""
    s = skip_spaces(buf, k, head_end)
    if s >= head_end or buf[s] != 47:
        return k
    d = skip_spaces(buf, s + 1, head_end)
    if d >= head_end or not is_digit(buf[d]):
        return k
    while d < head_end and is_digit(buf[d]):
        d += 1
    return d


@njit(cache=True, nogil=True)
def _stamp_then_r(buf, c, head_end):
    """Whether the message starts with a time's characters (a digit first, maybe in a bracket) and a blank,
    and then `rank` or `r` and a digit: a candidate for find_rank_marker's stamp-led patterns."""
    k = skip_spaces(buf, c, head_end)
    if k < head_end and buf[k] == 91:
        k += 1
    if k >= head_end or not is_digit(buf[k]):
        return False
    limit = min(head_end, k + 48)
    while k < limit:
        b = buf[k]
        if not (is_digit(b) or b == 45 or b == 58 or b == 46 or b == 44 or b == 84 or b == 90 or b == 43
                or b == 95 or b == 93 or b == 32 or b == 9):
            break
        k += 1
    if k >= head_end or (buf[k] | 32) != 114 or not (buf[k - 1] == 32 or buf[k - 1] == 9):
        return False
    return (k + 1 < head_end and is_digit(buf[k + 1])) or (k + 4 <= head_end and is_rank_at(buf, k))


@njit(cache=True, nogil=True)
def _after_a_bracket(buf, c, p, head_end):
    """Whether the "rank" at p follows `]` (or a letter: a level word such as `ERROR`, or a colon: a logger's
    name after the level, which the exact path checks) and blanks and is followed by ` ?digits: `."""
    k = p - 1
    if k < c or not (buf[k] == 32 or buf[k] == 9):
        return False
    while k >= c and (buf[k] == 32 or buf[k] == 9):
        k -= 1
    if k < c or not (buf[k] == 93 or buf[k] == 58 or 97 <= (buf[k] | 32) <= 122):
        return False
    k = p + 4
    if k < head_end and buf[k] == 32:
        k += 1
    start = k
    while k < head_end and is_digit(buf[k]):
        k += 1
    return start < k <= start + 9 and k + 1 < head_end and buf[k] == 58 and buf[k + 1] == 32


@njit(cache=True, nogil=True)
def _opening_marker(buf, c, head_end):
    """find_rank_marker's last two patterns: `^ *\\( *rank *(\\d{1,9}) *\\)` and `^ *> *rank +(\\d{1,9})\\b`."""
    k = skip_spaces(buf, c, head_end)
    if k >= head_end or not (buf[k] == 40 or buf[k] == 62):
        return -1
    paren = buf[k] == 40
    k = skip_spaces(buf, k + 1, head_end)
    if k + 4 > head_end or not is_rank_at(buf, k):
        return -1
    start = k + 4
    k = skip_spaces(buf, start, head_end)
    if not paren and k == start:
        return -1
    value, digits, k = number(buf, k, head_end, 9)
    if digits == 0 or digits > 9:
        return -1
    if paren:
        k = skip_spaces(buf, k, head_end)
        return value if k < head_end and buf[k] == 41 else -1
    return value if k >= head_end or not _is_word(buf[k]) else -1


@njit(cache=True, nogil=True)
def _word_at(buf, k, head_end, word):
    """Whether `word` (lower-case ASCII bytes) is at k in any case and followed by a `\\b`: 1 yes,
    0 no, -2 when a non-ASCII byte follows (whether it is a word character only the exact path
    can tell)."""
    n = word.shape[0]
    if k + n > head_end:
        return 0
    for j in range(n):
        if lower(buf[k + j]) != word[j]:
            return 0
    if k + n == head_end:
        return 1
    if buf[k + n] >= 128:
        return -2
    return 0 if _is_word(buf[k + n]) else 1


_NOT_OWN_WORDS = tuple(np.frombuffer(w.encode(), dtype=np.uint8) for w in NOT_OWN_WORDS)


@njit(cache=True, nogil=True)
def _own_word_at(buf, k, head_end, value):
    """Pattern 3's second branch: a word after `rank N ` (a script's own print), not one of NOT_OWN_WORDS."""
    for word in _NOT_OWN_WORDS:
        hit = _word_at(buf, k, head_end, word)
        if hit == 1:
            return -1
        if hit == -2:
            return -2
    c = buf[k] | 32
    return value if 97 <= c <= 122 else -1


@njit(cache=True, nogil=True)
def _is_word(c):
    return is_digit(c) or (65 <= c <= 90) or (97 <= c <= 122) or c == 95


@njit(cache=True, nogil=True)
def _assignment_marker_at(buf, c, p, head_end):
    q = p
    if q - 1 >= c and buf[q - 1] == 95 and global_before(buf, q - 1, c):
        before = q - 8
        if before < c or buf[before] == 32 or buf[before] == 44 or buf[before] == 40 or buf[before] == 124:
            q -= 7
    if q > c:
        b = buf[q - 1]
        if not (b == 32 or b == 44 or b == 40 or b == 124):
            return -1
        if _per_before(buf, c, q - 1):
            return -1   # a count per rank (`identities per rank: 1`), not a marker
    k = skip_spaces(buf, p + 4, head_end)
    if k >= head_end or not (buf[k] == 61 or buf[k] == 58):
        return -1
    value, digits, k = number(buf, skip_spaces(buf, k + 1, head_end), head_end, 9)
    if digits == 0 or digits > 9:
        return -1
    if k < head_end and _is_word(buf[k]):
        return -1
    return value


@njit(cache=True, nogil=True)
def _per_before(buf, c, q):
    """Whether the word `per` (any case, a word of its own) ends right before position q."""
    if q - 3 < c or (buf[q - 3] | 32) != 112 or (buf[q - 2] | 32) != 101 or (buf[q - 1] | 32) != 114:
        return False
    return q - 4 < c or not _is_word(buf[q - 4])


@njit(cache=True, nogil=True)
def _bracket_marker_at(buf, c, p, head_end):
    q = p
    if q - 1 >= c and (buf[q - 1] == 95 or buf[q - 1] == 32) and global_before(buf, q - 1, c):
        q -= 7
    q = spaces_before(buf, q, c)
    if q - 1 < c or buf[q - 1] != 91:
        # "global " may have been ordinary spaces: try without the optional word
        q = spaces_before(buf, p, c)
        if (q - 1 < c or buf[q - 1] != 91) and not _word_in_bracket(buf, c, q, p):
            return -1
    k = skip_spaces(buf, p + 4, head_end)
    if k < head_end and (buf[k] == 58 or buf[k] == 61 or buf[k] == 35):
        k += 1
    value, digits, k = number(buf, skip_spaces(buf, k, head_end), head_end, head_end)
    if digits == 0 or digits > 9:
        return -1
    k = skip_spaces(buf, k, head_end)
    if k < head_end and buf[k] == 47:
        _, d2, k = number(buf, skip_spaces(buf, k + 1, head_end), head_end, head_end)
        if d2 == 0:
            return -1
        k = skip_spaces(buf, k, head_end)
    if k < head_end and buf[k] == 93:
        return value
    return -1


@njit(cache=True, nogil=True)
def _word_in_bracket(buf, c, q, p):
    """Whether one word `[a-z][\\w.-]{0,31}` and the spaces q..p stand between a `[` and "rank" at p
    (a logging format's `[evch rank 3]`)."""
    if q == p:
        return False
    w = q
    while w - 1 >= c and (_is_word(buf[w - 1]) or buf[w - 1] == 46 or buf[w - 1] == 45):
        w -= 1
    if w == q or q - w > 32 or not (97 <= (buf[w] | 32) <= 122):
        return False
    s = spaces_before(buf, w, c)
    return s - 1 >= c and buf[s - 1] == 91


@njit(cache=True, nogil=True)
def user_marker_len(buf, k, end):
    """Length of `[Rr]ank ?\\d{1,9}\\] ` at k (split.py's user marker), else 0."""
    if k + 8 > end or buf[k] != 91 or (buf[k + 1] != 114 and buf[k + 1] != 82) or buf[k + 2] != 97 \
            or buf[k + 3] != 110 or buf[k + 4] != 107:
        return 0
    j = k + 5
    if j < end and buf[j] == 32:
        j += 1
    digits = 0
    while j < end and is_digit(buf[j]) and digits < 10:
        j += 1
        digits += 1
    if digits == 0 or digits > 9 or j + 1 >= end or buf[j] != 93 or buf[j + 1] != 32:
        return 0
    return j + 2 - k
