"""Byte readers of the prefixes launchers put in front of a line, for the fast path's kernel
(kernel.py): torch's excepthook `[rankN]: `, srun's `N: `, a log collector's RFC 3339 stamp, --tee's
`[roleN]:`, and the small byte tests they share. Each mirrors demux/prefix_shapes.py."""

from __future__ import annotations

from numba import njit


@njit(cache=True, nogil=True)
def is_digit(c):
    return 48 <= c <= 57


@njit(cache=True, nogil=True)
def lower(c):
    if 65 <= c <= 90:
        return c + 32
    return c


@njit(cache=True, nogil=True)
def _is_role_char(c):
    return (65 <= c <= 90) or (97 <= c <= 122) or c == 95 or c == 45


@njit(cache=True, nogil=True)
def skip_spaces(buf, k, end):
    while k < end and buf[k] == 32:
        k += 1
    return k


@njit(cache=True, nogil=True)
def spaces_before(buf, q, c):
    """q moved back over the spaces before it, not past c."""
    while q - 1 >= c and buf[q - 1] == 32:
        q -= 1
    return q


@njit(cache=True, nogil=True)
def number(buf, k, end, limit):
    """Decimal digits at k, at most `limit` + 1 read: (value, how many digits, index after them)."""
    value = 0
    digits = 0
    while k < end and is_digit(buf[k]) and digits <= limit:
        value = value * 10 + (buf[k] - 48)
        k += 1
        digits += 1
    return value, digits, k


@njit(cache=True, nogil=True)
def global_before(buf, q, c):
    """Whether `global` (any case) ends at q - 1, within the message that starts at c."""
    return q - 6 >= c and lower(buf[q - 6]) == 103 and lower(buf[q - 5]) == 108 and lower(buf[q - 4]) == 111 \
        and lower(buf[q - 3]) == 98 and lower(buf[q - 2]) == 97 and lower(buf[q - 1]) == 108


@njit(cache=True, nogil=True)
def excepthook(buf, i, end):
    """`[rank(\\d{1,12})\\]:( |(?=\\[)|$)` at i: (rank, message start) or (-1, -1)."""
    if end - i < 8 or buf[i] != 91 or buf[i + 1] != 114 or buf[i + 2] != 97 or buf[i + 3] != 110 or buf[i + 4] != 107:
        return -1, -1
    value, digits, k = number(buf, i + 5, end, 12)
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
def srun_label(buf, i, end):
    """Slurm's `srun --label` prefix, ` {0,6}(\\d{1,7}): ` at i: (task, message start) or (-1, -1)."""
    k = i
    while k < end and k - i < 6 and buf[k] == 32:
        k += 1
    value, digits, k = number(buf, k, end, 7)
    if digits == 0 or digits > 7 or k + 1 >= end or buf[k] != 58 or buf[k + 1] != 32:
        return -1, -1
    return value, k + 2


@njit(cache=True, nogil=True)
def _two_digits(buf, k, end):
    """The index after exactly two digits at k (more may follow), or -1."""
    return k + 2 if k + 1 < end and is_digit(buf[k]) and is_digit(buf[k + 1]) else -1


@njit(cache=True, nogil=True)
def collector_stamp(buf, i, end):
    """A log collector's RFC 3339 time, `\\d{4}-\\d\\d-\\d\\dT\\d\\d:\\d\\d:\\d\\d(\\.\\d{1,9})?(Z|[+-]\\d\\d:?\\d\\d):?[ \\t]`
    at i (demux prefix_shapes.COLLECTOR_STAMP): the message start after it, or -1."""
    k = i
    for width, sep in ((4, 45), (2, 45), (2, 84), (2, 58), (2, 58), (2, -1)):   # 2023-05-26T16:48:07
        _, digits, k = number(buf, k, end, width)
        if digits != width or (sep >= 0 and (k >= end or buf[k] != sep)):
            return -1
        k += 1 if sep >= 0 else 0
    if k < end and buf[k] == 46:                       # .093268664
        _, digits, k = number(buf, k + 1, end, 9)
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
def tee(buf, i, end):
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
    value, digits, k = number(buf, k, end, 7)
    if digits == 0 or digits > 7 or k + 1 >= end or buf[k] != 93 or buf[k + 1] != 58:
        return -1, -1
    if role_end - (i + 1) == 4 and buf[i + 1] == 114 and buf[i + 2] == 97 and buf[i + 3] == 110 and buf[i + 4] == 107:
        return -1, -1  # "[rankN]:" is the excepthook prefix, not a tee header
    return value, k + 2
