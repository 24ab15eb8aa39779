"""The byte-level pass of the fast path, compiled with numba.

For every line of a chunk it finds where the line starts, where its message starts (after the
`[roleN]:` / `[rankN]: ` / `[rankN]:[` prefixes), the rank those prefixes or a `[rank N]`
marker name, and whether the line is *plain*: a line the exact per-line path would assign to
that rank (or to "unattributed") without opening, continuing or closing anything and without
any rule able to match it. Everything this kernel cannot decide is flagged NOT_PLAIN and goes
through `LineScanner.line`; the catalog prefilter (prefilter.py) flags the rest.

The decisions mirror demux/prefixes.py, demux/split.py and line_marks.find_rank_marker (the byte
readers of prefixes, markers and line shapes are in kernel_prefixes.py, kernel_markers.py and
kernel_lines.py); the
equality test (tests/test_fastscan.py) runs both paths on every sample log.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from logtriage.fastscan.flags import (  # noqa: F401
    COLLECTOR_STAMP, EMPTY, INHERIT, NO_RANK, NOT_PLAIN, SRUN_LABEL, STEP, STEP2)
from logtriage.fastscan.kernel_lines import (
    bar_then_text, bare_glued, has_high, has_pid, has_rank, is_step_at, is_stream_tag, leading, redraw)
from logtriage.fastscan.kernel_markers import bracket_is_plain, marker, user_marker_len
from logtriage.fastscan.kernel_prefixes import collector_stamp, excepthook, is_digit, srun_label, tee

MAX_PLAIN_LINE = 1900       # longer lines take the exact path (its step/world checks are length-bound)


@njit(cache=True, nogil=True)
def count_lines(buf):
    n = 0
    for i in range(buf.shape[0]):
        if buf[i] == 10:
            n += 1
    if buf.shape[0] > 0 and buf[buf.shape[0] - 1] != 10:
        n += 1
    return n


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
    `te` (in the word, or as its last byte), or `it ` or `it=` (`t ` or `t=` as the first bytes: `i` ended
    the last word)."""
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
    space = _zero_bytes(x ^ (_ONES * np.uint64(32))) | _zero_bytes(x ^ (_ONES * np.uint64(61)))   # or `=`
    return ((i & (t >> np.uint64(8)) & (space >> np.uint64(16))) | (t & (space >> np.uint64(8)) & np.uint64(0x80))) != 0


@njit(cache=True, nogil=True)
def _scan_bytes(buf, classes, ends, bad, last_colon, first_step, last_step, brackets, last_cr, high):
    """One pass over the chunk: line ends, and per line whether it holds a byte a plain line may
    not, where its last `]:` is, where "tep"/"ter" (or "it N", "it=N") first and last occur, how many `[` it has."""
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
            if is_step_at(buf, k, size):
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
            a, b = redraw(buf, line_start, end)
            # non-ASCII in the part shown is harmless where no character-counting rule looks:
            # no rank marker (a 120-character window) and no bracket prefix (120 characters)
            if a >= 0 and not (high[n] and has_high(buf, a, b) and (buf[a] == 91 or has_rank(buf, a, b))) \
                    and not bar_then_text(buf, a, b):   # a message glued after a bar: the exact path cuts it
                i = a
                end = b
                redrawn = True
        if stamped and not redrawn:
            after = collector_stamp(buf, i, end)
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
                task, after = srun_label(buf, i, end)
                if task >= 0:
                    rank = task
                    c = after
                    explicit = True
                    labelled = True
            if c < end and buf[c] == 91:
                local, after = tee(buf, c, end)
                if local >= 0:
                    if labelled:
                        flag = NOT_PLAIN   # a task label and a local rank: the exact path weighs them
                    rank = local
                    c = after
                    explicit = True
                global_rank, after = excepthook(buf, c, end)
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
                    and is_digit(buf[c + 1]) and is_digit(buf[c + 2]) and is_digit(buf[c + 3]) \
                    and is_digit(buf[c + 4]) and buf[c + 5] == 32:
                flag = NOT_PLAIN  # py-glog header: the launcher or a worker pid
            elif first == 70 and c + 5 < end and buf[c + 1] == 105 and buf[c + 2] == 108 and buf[c + 3] == 101 \
                    and buf[c + 4] == 32 and buf[c + 5] == 34:
                flag = NOT_PLAIN  # `File "...` at column 0: a traceback frame, maybe one without its header
            elif first == 40 and has_pid(buf, c, min(end, c + 80)):
                flag = NOT_PLAIN  # a Ray worker's `(Name pid=N, ip=...) ` prefix
            elif first == 91 and is_stream_tag(buf, c, end):
                flag = NOT_PLAIN  # a wrapper's `[stdout]`/`[stderr]` tag: the exact path strips it
            elif first == 91:
                is_cpp = c + 2 < end and (buf[c + 1] == 73 or buf[c + 1] == 87 or buf[c + 1] == 69
                                          or buf[c + 1] == 70) and is_digit(buf[c + 2])
                if not is_cpp and not bracket_is_plain(buf, c, end):
                    flag = NOT_PLAIN
        if flag == 0 and buf[c] == 114 and bare_glued(buf, c, end):
            flag = NOT_PLAIN   # `rank 1 step 0 ... 0.125rank 2: ERROR ...`: two ranks' prints, cut by the exact path
        if flag == 0 and not redrawn and brackets[n] >= 1 and bar_then_text(buf, c, end):
            # a bar with another rank's print glued after its rate (`rank2 erosion:   0%|   | 0/6 [00:00<?,
            # ?it/s]rank 0 step 0 ...`): the line is the print's, as the exact path reads it
            flag = NOT_PLAIN
        if flag == 0 and c == i and brackets[n] >= 2 and user_marker_len(buf, c, end) > 0:
            # two ranks' prints glued on one line: `[rank 0] step 1 ...[rank 1] step 1 ...`
            lead = leading(buf, i, end)
            found = 0
            for k in range(max(lead + 1, i + 1), end):
                if buf[k] == 91 and user_marker_len(buf, k, end) > 0:
                    found += 1
                    if found == 1:
                        cut = k - i
            if found > 1:
                flag = NOT_PLAIN  # three or more parts: the exact path
            elif found == 1:
                rank2 = rank_hint if rank_hint >= 0 else marker(buf, i + cut, end, scratch)
                if rank2 == -2:
                    flag = NOT_PLAIN
        if flag == 0 and not explicit:
            rank = marker(buf, c, i + cut if cut > 0 else end, scratch)
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

