"""The byte-level pass of the fast path, compiled with numba.

For every line of a chunk it finds where the line starts, where its message starts (after the
`[roleN]:` / `[rankN]: ` / `[rankN]:[` prefixes), the rank those prefixes or a `[rank N]`
marker name, and whether the line is *plain*: a line the exact per-line path would assign to
that rank (or to "unattributed") without opening, continuing or closing anything and without
any rule able to match it. Everything this kernel cannot decide is flagged NOT_PLAIN and goes
through `LineScanner.line`; the catalog prefilter (prefilter.py) flags the rest.

The decisions mirror demux/prefixes.py, demux/split.py and assigner.find_rank_marker; the
equality test (tests/test_fastscan.py) runs both paths on every sample log.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from logtriage.fastscan.flags import (  # noqa: F401
    COLLECTOR_STAMP, EMPTY, INHERIT, NO_RANK, NOT_PLAIN, SRUN_LABEL, STEP, STEP2)

MAX_PLAIN_LINE = 1900       # longer lines take the exact path (its step/world checks are length-bound)
MARKER_HEAD = 120           # find_rank_marker looks at text[:120]


@njit(cache=True, nogil=True)
def count_lines(buf):
    n = 0
    for i in range(buf.shape[0]):
        if buf[i] == 10:
            n += 1
    if buf.shape[0] > 0 and buf[buf.shape[0] - 1] != 10:
        n += 1
    return n


@njit(cache=True, nogil=True)
def _is_digit(c):
    return 48 <= c <= 57


@njit(cache=True, nogil=True)
def _lower(c):
    if 65 <= c <= 90:
        return c + 32
    return c


@njit(cache=True, nogil=True)
def _is_role_char(c):
    return (65 <= c <= 90) or (97 <= c <= 122) or c == 95 or c == 45


@njit(cache=True, nogil=True)
def _skip_spaces(buf, k, end):
    while k < end and buf[k] == 32:
        k += 1
    return k


@njit(cache=True, nogil=True)
def _spaces_before(buf, q, c):
    """q moved back over the spaces before it, not past c."""
    while q - 1 >= c and buf[q - 1] == 32:
        q -= 1
    return q


@njit(cache=True, nogil=True)
def _number(buf, k, end, limit):
    """Decimal digits at k, at most `limit` + 1 read: (value, how many digits, index after them)."""
    value = 0
    digits = 0
    while k < end and _is_digit(buf[k]) and digits <= limit:
        value = value * 10 + (buf[k] - 48)
        k += 1
        digits += 1
    return value, digits, k


@njit(cache=True, nogil=True)
def _global_before(buf, q, c):
    """Whether `global` (any case) ends at q - 1, within the message that starts at c."""
    return q - 6 >= c and _lower(buf[q - 6]) == 103 and _lower(buf[q - 5]) == 108 and _lower(buf[q - 4]) == 111 \
        and _lower(buf[q - 3]) == 98 and _lower(buf[q - 2]) == 97 and _lower(buf[q - 1]) == 108


@njit(cache=True, nogil=True)
def _excepthook(buf, i, end):
    """`[rank(\\d{1,12})\\]:( |(?=\\[)|$)` at i: (rank, message start) or (-1, -1)."""
    if end - i < 8 or buf[i] != 91 or buf[i + 1] != 114 or buf[i + 2] != 97 or buf[i + 3] != 110 or buf[i + 4] != 107:
        return -1, -1
    value, digits, k = _number(buf, i + 5, end, 12)
    if digits == 0 or digits > 12 or k >= end or buf[k] != 93:
        return -1, -1
    if k + 1 >= end or buf[k + 1] != 58:
        return -1, -1
    k += 2
    if k == end:
        return value, k
    if buf[k] == 32:
        return value, k + 1
    if buf[k] == 91:
        return value, k
    return -1, -1


@njit(cache=True, nogil=True)
def _srun_label(buf, i, end):
    """Slurm's `srun --label` prefix, ` {0,6}(\\d{1,7}): ` at i: (task, message start) or (-1, -1)."""
    k = i
    while k < end and k - i < 6 and buf[k] == 32:
        k += 1
    value, digits, k = _number(buf, k, end, 7)
    if digits == 0 or digits > 7 or k + 1 >= end or buf[k] != 58 or buf[k + 1] != 32:
        return -1, -1
    return value, k + 2


@njit(cache=True, nogil=True)
def _two_digits(buf, k, end):
    """The index after exactly two digits at k (more may follow), or -1."""
    return k + 2 if k + 1 < end and _is_digit(buf[k]) and _is_digit(buf[k + 1]) else -1


@njit(cache=True, nogil=True)
def _collector_stamp(buf, i, end):
    """A log collector's RFC 3339 time, `\\d{4}-\\d\\d-\\d\\dT\\d\\d:\\d\\d:\\d\\d(\\.\\d{1,9})?(Z|[+-]\\d\\d:?\\d\\d):?[ \\t]`
    at i (demux prefix_shapes.COLLECTOR_STAMP): the message start after it, or -1."""
    k = i
    for width, sep in ((4, 45), (2, 45), (2, 84), (2, 58), (2, 58), (2, -1)):   # 2023-05-26T16:48:07
        _, digits, k = _number(buf, k, end, width)
        if digits != width or (sep >= 0 and (k >= end or buf[k] != sep)):
            return -1
        k += 1 if sep >= 0 else 0
    if k < end and buf[k] == 46:                       # .093268664
        _, digits, k = _number(buf, k + 1, end, 9)
        if digits == 0 or digits > 9:
            return -1
    if k < end and buf[k] == 90:                       # Z
        k += 1
    elif k < end and (buf[k] == 43 or buf[k] == 45):   # +02:00, -0500
        k = _two_digits(buf, k + 1, end)
        if k >= 0 and k < end and buf[k] == 58:
            k += 1
        k = _two_digits(buf, k, end) if k >= 0 else -1
        if k < 0:
            return -1
    else:
        return -1
    if k < end and buf[k] == 58:                       # closed by `: ` on some consoles
        k += 1
    return k + 1 if k < end and (buf[k] == 32 or buf[k] == 9) else -1


@njit(cache=True, nogil=True)
def _tee(buf, i, end):
    """`[role(\\d{1,7})\\]:` at i with role letters/_/- (not "rank"): (local rank, after) or (-1, -1)."""
    if end - i < 4 or buf[i] != 91:
        return -1, -1
    k = i + 1
    first = buf[k]
    if not ((65 <= first <= 90) or (97 <= first <= 122) or first == 95):
        return -1, -1
    while k < end and _is_role_char(buf[k]):
        k += 1
    role_end = k
    value, digits, k = _number(buf, k, end, 7)
    if digits == 0 or digits > 7 or k + 1 >= end or buf[k] != 93 or buf[k + 1] != 58:
        return -1, -1
    if role_end - (i + 1) == 4 and buf[i + 1] == 114 and buf[i + 2] == 97 and buf[i + 3] == 110 and buf[i + 4] == 107:
        return -1, -1  # "[rankN]:" is the excepthook prefix, not a tee header
    return value, k + 2


@njit(cache=True, nogil=True)
def _bracket_is_plain(buf, c, end):
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
        if not _is_digit(ch):
            all_digits = False
        k += 1
    return True


@njit(cache=True, nogil=True)
def _is_rank_at(buf, p):
    # b | 32 folds ASCII case and maps no other byte onto these letters
    return (buf[p] | 32) == 114 and (buf[p + 1] | 32) == 97 and (buf[p + 2] | 32) == 110 and (buf[p + 3] | 32) == 107


@njit(cache=True, nogil=True)
def _marker(buf, c, end, found):
    """assigner.find_rank_marker on an unprefixed message, within its first 120 characters
    (case-insensitive), trying its three patterns in order:
    1. `[ *(global[_ ])?rank *[:=#]? *(\\d{1,9}) *(/ *\\d+ *)?]`
    2. `(^|[ ,(|])(global_)?rank *[=:] *(\\d{1,9})\\b`
    3. `^ *rank *(\\d{1,9})( *[:|\\]]| +(step|epoch|iter|iteration|loss|batch|done|finished)\\b)`
    Returns the rank, -1 for none, or -2 where only the exact path can tell."""
    head_end = min(end, c + MARKER_HEAD)
    count = 0   # `found` (scratch space) gets where "rank" occurs: at most 8, beyond that the exact path
    for p in range(c, head_end - 3):
        if (buf[p] | 32) == 114 and _is_rank_at(buf, p):
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
    k = _skip_spaces(buf, c, head_end)
    if k + 4 <= head_end and _is_rank_at(buf, k):
        value, digits, k = _number(buf, _skip_spaces(buf, k + 4, head_end), head_end, 9)
        if 0 < digits <= 9:
            after = k
            k = _skip_spaces(buf, k, head_end)
            if k < head_end and (buf[k] == 58 or buf[k] == 124 or buf[k] == 93):
                return value
            if k > after:
                hit = _progress_word_at(buf, k, head_end, value)
                if hit != -1:
                    return hit
    return _opening_marker(buf, c, head_end)


@njit(cache=True, nogil=True)
def _opening_marker(buf, c, head_end):
    """find_rank_marker's last two patterns: `^ *\\( *rank *(\\d{1,9}) *\\)` and `^ *> *rank +(\\d{1,9})\\b`."""
    k = _skip_spaces(buf, c, head_end)
    if k >= head_end or not (buf[k] == 40 or buf[k] == 62):
        return -1
    paren = buf[k] == 40
    k = _skip_spaces(buf, k + 1, head_end)
    if k + 4 > head_end or not _is_rank_at(buf, k):
        return -1
    start = k + 4
    k = _skip_spaces(buf, start, head_end)
    if not paren and k == start:
        return -1
    value, digits, k = _number(buf, k, head_end, 9)
    if digits == 0 or digits > 9:
        return -1
    if paren:
        k = _skip_spaces(buf, k, head_end)
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
        if _lower(buf[k + j]) != word[j]:
            return 0
    if k + n == head_end:
        return 1
    if buf[k + n] >= 128:
        return -2
    return 0 if _is_word(buf[k + n]) else 1


_PROGRESS_WORDS = tuple(np.frombuffer(w, dtype=np.uint8) for w in (
    b"step", b"epoch", b"iter", b"iteration", b"loss", b"batch", b"done", b"finished"))


@njit(cache=True, nogil=True)
def _progress_word_at(buf, k, head_end, value):
    """Pattern 3's second branch: a progress word after `rank N ` (a script's own print)."""
    for word in _PROGRESS_WORDS:
        hit = _word_at(buf, k, head_end, word)
        if hit == 1:
            return value
        if hit == -2:
            return -2
    return -1


@njit(cache=True, nogil=True)
def _is_word(c):
    return _is_digit(c) or (65 <= c <= 90) or (97 <= c <= 122) or c == 95


@njit(cache=True, nogil=True)
def _assignment_marker_at(buf, c, p, head_end):
    q = p
    if q - 1 >= c and buf[q - 1] == 95 and _global_before(buf, q - 1, c):
        before = q - 8
        if before < c or buf[before] == 32 or buf[before] == 44 or buf[before] == 40 or buf[before] == 124:
            q -= 7
    if q > c:
        b = buf[q - 1]
        if not (b == 32 or b == 44 or b == 40 or b == 124):
            return -1
    k = _skip_spaces(buf, p + 4, head_end)
    if k >= head_end or not (buf[k] == 61 or buf[k] == 58):
        return -1
    value, digits, k = _number(buf, _skip_spaces(buf, k + 1, head_end), head_end, 9)
    if digits == 0 or digits > 9:
        return -1
    if k < head_end and _is_word(buf[k]):
        return -1
    return value


@njit(cache=True, nogil=True)
def _bracket_marker_at(buf, c, p, head_end):
    q = p
    if q - 1 >= c and (buf[q - 1] == 95 or buf[q - 1] == 32) and _global_before(buf, q - 1, c):
        q -= 7
    q = _spaces_before(buf, q, c)
    if q - 1 < c or buf[q - 1] != 91:
        # "global " may have been ordinary spaces: try without the optional word
        q = _spaces_before(buf, p, c)
        if q - 1 < c or buf[q - 1] != 91:
            return -1
    k = _skip_spaces(buf, p + 4, head_end)
    if k < head_end and (buf[k] == 58 or buf[k] == 61 or buf[k] == 35):
        k += 1
    value, digits, k = _number(buf, _skip_spaces(buf, k, head_end), head_end, head_end)
    if digits == 0 or digits > 9:
        return -1
    k = _skip_spaces(buf, k, head_end)
    if k < head_end and buf[k] == 47:
        _, d2, k = _number(buf, _skip_spaces(buf, k + 1, head_end), head_end, head_end)
        if d2 == 0:
            return -1
        k = _skip_spaces(buf, k, head_end)
    if k < head_end and buf[k] == 93:
        return value
    return -1


@njit(cache=True, nogil=True)
def _user_marker_len(buf, k, end):
    """Length of `[Rr]ank ?\\d{1,9}\\] ` at k (split.py's user marker), else 0."""
    if k + 8 > end or buf[k] != 91 or (buf[k + 1] != 114 and buf[k + 1] != 82) or buf[k + 2] != 97 \
            or buf[k + 3] != 110 or buf[k + 4] != 107:
        return 0
    j = k + 5
    if j < end and buf[j] == 32:
        j += 1
    digits = 0
    while j < end and _is_digit(buf[j]) and digits < 10:
        j += 1
        digits += 1
    if digits == 0 or digits > 9 or j + 1 >= end or buf[j] != 93 or buf[j + 1] != 32:
        return 0
    return j + 2 - k


@njit(cache=True, nogil=True)
def _leading(buf, i, end):
    """End of split.py's _LEADING: `(\\d{1,7}: )?(\\[[^\\[\\]]{1,120}\\](:|(?=\\[))? ?)*`."""
    k = i
    d = 0
    while k < end and _is_digit(buf[k]) and d < 8:
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
def _is_step_at(buf, k, size):
    """Whether the `t` at k starts "tep"/"ter" (step, iter, iteration), or ends a word "it" that a
    counter follows (`it 3/7`)."""
    if k + 2 >= size:
        return False
    if buf[k + 1] == 101 and (buf[k + 2] == 112 or buf[k + 2] == 114):
        return True
    return (buf[k + 1] == 32 and _is_digit(buf[k + 2]) and k >= 1 and buf[k - 1] == 105
            and (k < 2 or not _is_word_byte(buf[k - 2])))


# Byte classes for the one pass over a chunk (_scan_bytes).
_NEWLINE, _BAD, _BRACKET_CLOSE, _T, _BRACKET_OPEN, _CR, _HIGH = 1, 2, 3, 4, 5, 6, 7
BYTE_CLASS = np.zeros(256, dtype=np.uint8)
BYTE_CLASS[:32] = _BAD          # controls: ESC, CR, TAB, NUL... (cleaning would change the line)
BYTE_CLASS[127] = _BAD          # DEL
BYTE_CLASS[128:] = _HIGH        # non-ASCII: decoding could change it (fine in the part a redraw hides)
BYTE_CLASS[10] = _NEWLINE
BYTE_CLASS[93] = _BRACKET_CLOSE
BYTE_CLASS[116] = _T
BYTE_CLASS[91] = _BRACKET_OPEN
BYTE_CLASS[13] = _CR            # tqdm redraws: the line shows what follows the last CR


_ONES = np.uint64(0x0101010101010101)
_HIGHS = np.uint64(0x8080808080808080)


@njit(cache=True, nogil=True, inline="always")
def _zero_bytes(x):
    """The high bit of every zero byte of x is set (and maybe of a byte above one: never a miss)."""
    return (x - _ONES) & ~x & _HIGHS


@njit(cache=True, nogil=True, inline="always")
def _special_word(x):
    """Whether the 8 bytes in x (little-endian) may hold a byte _scan_bytes must look at, false
    positives allowed: a control byte (< 32), DEL or non-ASCII, `[` or `]`, or a `t` that starts
    `te` (in the word, or as its last byte), or `it ` (`t ` as the first bytes: `i` ended the last word)."""
    if (x & _HIGHS) != 0 or ((x - _ONES * np.uint64(32)) & ~x & _HIGHS) != 0:
        return True
    if (_zero_bytes(x ^ (_ONES * np.uint64(91))) | _zero_bytes(x ^ (_ONES * np.uint64(93)))
            | _zero_bytes(x ^ (_ONES * np.uint64(127)))) != 0:
        return True
    t = _zero_bytes(x ^ (_ONES * np.uint64(116)))
    e = _zero_bytes(x ^ (_ONES * np.uint64(101)))
    if ((t & (e >> np.uint64(8))) | (t >> np.uint64(63))) != 0:
        return True
    i = _zero_bytes(x ^ (_ONES * np.uint64(105)))
    space = _zero_bytes(x ^ (_ONES * np.uint64(32)))
    return ((i & (t >> np.uint64(8)) & (space >> np.uint64(16))) | (t & (space >> np.uint64(8)) & np.uint64(0x80))) != 0


@njit(cache=True, nogil=True)
def _scan_bytes(buf, classes, ends, bad, last_colon, first_step, last_step, brackets, last_cr, high):
    """One pass over the chunk: line ends, and per line whether it holds a byte a plain line may
    not, where its last `]:` is, where "tep"/"ter" (or "it N") first and last occur, how many `[` it has."""
    n = 0
    size = buf.shape[0]
    is_bad = False
    colon = -1
    step_a = -1
    step_b = -1
    opens = 0
    cr = -1
    is_high = False
    words = buf[:size - size % 8].view(np.uint64)
    k = -1
    while True:
        k += 1
        if k & 7 == 0:
            # eight bytes at a time while none of them is special (most of a log's bytes)
            while (k >> 3) < words.shape[0] and not _special_word(words[k >> 3]):
                k += 8
        if k >= size:
            break
        c = classes[buf[k]]
        if c == 0:
            continue
        if c == _NEWLINE:
            ends[n] = k
            bad[n] = is_bad
            last_colon[n] = colon
            first_step[n] = step_a
            last_step[n] = step_b
            brackets[n] = opens
            last_cr[n] = cr
            high[n] = is_high
            n += 1
            is_high = False
            is_bad = False
            colon = -1
            step_a = -1
            step_b = -1
            opens = 0
            cr = -1
        elif c == _BAD:
            is_bad = True
        elif c == _CR:
            cr = k
        elif c == _HIGH:
            is_high = True
        elif c == _BRACKET_CLOSE:
            if k + 1 < size and buf[k + 1] == 58:
                colon = k
        elif c == _T:
            if _is_step_at(buf, k, size):
                if step_a < 0:
                    step_a = k
                step_b = k
        else:
            opens += 1
    if size > 0 and buf[size - 1] != 10:   # a last line without its newline
        ends[n] = size
        bad[n] = is_bad
        last_colon[n] = colon
        first_step[n] = step_a
        last_step[n] = step_b
        brackets[n] = opens
        last_cr[n] = cr
        high[n] = is_high
        n += 1
    return n


@njit(cache=True, nogil=True)
def _is_bar(buf, a, b):
    """clean._PROGRESS_BAR on buf[a:b]: `\\d%\\|`, `\\d(it/s|s/it)\\]` or `\\[\\d\\d:\\d\\d<`."""
    for k in range(a, b):
        ch = buf[k]
        if _is_digit(ch):
            if k + 2 < b and buf[k + 1] == 37 and buf[k + 2] == 124:
                return True
            if k + 5 < b and buf[k + 5] == 93 and ((buf[k + 1] == 105 and buf[k + 2] == 116 and buf[k + 3] == 47
                                                    and buf[k + 4] == 115)
                                                   or (buf[k + 1] == 115 and buf[k + 2] == 47 and buf[k + 3] == 105
                                                       and buf[k + 4] == 116)):
                return True
        elif ch == 91 and k + 6 < b and _is_digit(buf[k + 1]) and _is_digit(buf[k + 2]) and buf[k + 3] == 58 \
                and _is_digit(buf[k + 4]) and _is_digit(buf[k + 5]) and buf[k + 6] == 60:
            return True
    return False


@njit(cache=True, nogil=True)
def _bar_then_text(buf, a, b):
    """clean._BAR_THEN_TEXT on buf[a:b]: a bar's rate `[\\d?](it/s|s/it)]` with text glued after it."""
    for k in range(a, b - 6):
        ch = buf[k]
        if (_is_digit(ch) or ch == 63) and buf[k + 5] == 93 and buf[k + 6] != 32 \
                and ((buf[k + 1] == 105 and buf[k + 2] == 116 and buf[k + 3] == 47 and buf[k + 4] == 115)
                     or (buf[k + 1] == 115 and buf[k + 2] == 47 and buf[k + 3] == 105 and buf[k + 4] == 116)):
            return True
    return False


@njit(cache=True, nogil=True)
def _has_high(buf, a, b):
    for k in range(a, b):
        if buf[k] > 127:
            return True
    return False


@njit(cache=True, nogil=True)
def _has_rank(buf, a, b):
    for k in range(a, b - 3):
        if _is_rank_at(buf, k):
            return True
    return False


@njit(cache=True, nogil=True)
def _is_stream_tag(buf, c, end):
    """`[stdout]` or `[stderr]` at c."""
    if end - c < 8 or buf[c + 1] != 115 or buf[c + 2] != 116 or buf[c + 3] != 100 or buf[c + 7] != 93:
        return False   # not "[std...]"
    return (buf[c + 4] == 111 and buf[c + 5] == 117 and buf[c + 6] == 116) or \
        (buf[c + 4] == 101 and buf[c + 5] == 114 and buf[c + 6] == 114)


@njit(cache=True, nogil=True)
def _has_pid(buf, a, b):
    for k in range(a, b - 3):
        if buf[k] == 112 and buf[k + 1] == 105 and buf[k + 2] == 100 and buf[k + 3] == 61:   # "pid="
            return True
    return False


@njit(cache=True, nogil=True)
def _redraw(buf, start, end):
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
                    if not _is_bar(buf, a, b):
                        return a, b
                elif not _is_bar(buf, a, b):
                    return a, b
            b = k
        k -= 1
    return last_a, last_b


@njit(cache=True, nogil=True)
def classify(buf, rank_hint, labels, starts, messages, ranks, flags, cuts, ranks2):
    """Fill the per-line arrays for `buf` (whole lines); returns the number of lines. `labels`
    (flags.SRUN_LABEL | flags.COLLECTOR_STAMP): the log uses Slurm's `--label` prefix and its tasks
    are ranks (demux Dialect.srun, not srun_nodes); every line starts with a collector's time."""
    srun = (labels & SRUN_LABEL) != 0
    stamped = (labels & COLLECTOR_STAMP) != 0
    cap = starts.shape[0]
    ends = np.empty(cap, dtype=np.int64)
    bad = np.empty(cap, dtype=np.bool_)
    last_colon = np.empty(cap, dtype=np.int64)
    first_step = np.empty(cap, dtype=np.int64)
    last_step = np.empty(cap, dtype=np.int64)
    brackets = np.empty(cap, dtype=np.int64)
    last_cr = np.empty(cap, dtype=np.int64)
    high = np.empty(cap, dtype=np.bool_)
    scratch = np.empty(8, dtype=np.int64)
    count = _scan_bytes(buf, BYTE_CLASS, ends, bad, last_colon, first_step, last_step, brackets, last_cr, high)
    line_start = 0
    for n in range(count):
        end = ends[n]
        i = line_start
        redrawn = False
        if last_cr[n] >= 0 and not bad[n]:
            # a tqdm line: cleaning keeps the part the terminal finally shows
            a, b = _redraw(buf, line_start, end)
            # non-ASCII in the part shown is harmless where no character-counting rule looks:
            # no rank marker (a 120-character window) and no bracket prefix (120 characters)
            if a >= 0 and not (high[n] and _has_high(buf, a, b) and (buf[a] == 91 or _has_rank(buf, a, b))) \
                    and not _bar_then_text(buf, a, b):   # a message glued after a bar: the exact path cuts it
                i = a
                end = b
                redrawn = True
        if stamped and not redrawn:
            after = _collector_stamp(buf, i, end)
            if after >= 0:
                i = after
        flag = 0
        rank = NO_RANK
        cut = 0
        rank2 = NO_RANK
        c = i
        if end == i:
            flag = EMPTY
            rank = rank_hint if rank_hint >= 0 else INHERIT
        elif bad[n] or ends[n] - line_start > MAX_PLAIN_LINE or (last_cr[n] >= 0 and not redrawn) \
                or (high[n] and not redrawn):
            flag = NOT_PLAIN
        explicit = False
        if flag == 0:
            labelled = False
            if srun:
                task, after = _srun_label(buf, i, end)
                if task >= 0:
                    rank = task
                    c = after
                    explicit = True
                    labelled = True
            if c < end and buf[c] == 91:
                local, after = _tee(buf, c, end)
                if local >= 0:
                    if labelled:
                        flag = NOT_PLAIN   # a task label and a local rank: the exact path weighs them
                    rank = local
                    c = after
                    explicit = True
                global_rank, after = _excepthook(buf, c, end)
                if global_rank >= 0:
                    rank = global_rank
                    c = after
                    explicit = True
            if not explicit and rank_hint >= 0:
                rank = rank_hint
                explicit = True
            if c >= end or buf[c] == 32 or buf[c] == 9 or last_colon[n] >= c:
                flag = NOT_PLAIN   # empty message, a continuation (or an indented paste), or a `]:` glued inside the message
        if flag == 0:
            first = buf[c]
            if first == 43 or first == 42 or first == 61 or first == 45 or first == 60 or first == 124:
                flag = NOT_PLAIN  # shell `+ `, banners `***`/`===`, `-- Process`, `----`, `<...>`, a group's `| `
            elif (first == 73 or first == 87 or first == 69 or first == 67) and c + 5 < end \
                    and _is_digit(buf[c + 1]) and _is_digit(buf[c + 2]) and _is_digit(buf[c + 3]) \
                    and _is_digit(buf[c + 4]) and buf[c + 5] == 32:
                flag = NOT_PLAIN  # py-glog header: the launcher or a worker pid
            elif first == 70 and c + 5 < end and buf[c + 1] == 105 and buf[c + 2] == 108 and buf[c + 3] == 101 \
                    and buf[c + 4] == 32 and buf[c + 5] == 34:
                flag = NOT_PLAIN  # `File "...` at column 0: a traceback frame, maybe one without its header
            elif first == 40 and _has_pid(buf, c, min(end, c + 80)):
                flag = NOT_PLAIN  # a Ray worker's `(Name pid=N, ip=...) ` prefix
            elif first == 91 and _is_stream_tag(buf, c, end):
                flag = NOT_PLAIN  # a wrapper's `[stdout]`/`[stderr]` tag: the exact path strips it
            elif first == 91:
                is_cpp = c + 2 < end and (buf[c + 1] == 73 or buf[c + 1] == 87 or buf[c + 1] == 69
                                          or buf[c + 1] == 70) and _is_digit(buf[c + 2])
                if not is_cpp and not _bracket_is_plain(buf, c, end):
                    flag = NOT_PLAIN
        if flag == 0 and c == i and brackets[n] >= 2 and _user_marker_len(buf, c, end) > 0:
            # two ranks' prints glued on one line: `[rank 0] step 1 ...[rank 1] step 1 ...`
            lead = _leading(buf, i, end)
            found = 0
            for k in range(max(lead + 1, i + 1), end):
                if buf[k] == 91 and _user_marker_len(buf, k, end) > 0:
                    found += 1
                    if found == 1:
                        cut = k - i
            if found > 1:
                flag = NOT_PLAIN  # three or more parts: the exact path
            elif found == 1:
                rank2 = rank_hint if rank_hint >= 0 else _marker(buf, i + cut, end, scratch)
                if rank2 == -2:
                    flag = NOT_PLAIN
        if flag == 0 and not explicit:
            rank = _marker(buf, c, i + cut if cut > 0 else end, scratch)
            if rank == -2:
                rank = NO_RANK
                flag = NOT_PLAIN
        if flag == 0 and first_step[n] >= c:
            if cut == 0 or first_step[n] + 2 < i + cut:
                flag |= STEP
            if cut > 0 and last_step[n] >= i + cut:
                flag |= STEP2
        elif flag == 0 and last_step[n] >= c:
            if cut == 0 or last_step[n] + 2 < i + cut:
                flag |= STEP
            if cut > 0 and last_step[n] >= i + cut:
                flag |= STEP2
        starts[n] = line_start
        messages[n] = c - line_start
        ranks[n] = rank
        flags[n] = flag
        cuts[n] = cut + (i - line_start if cut > 0 else 0)
        ranks2[n] = rank2
        line_start = ends[n] + 1
    return count

