"""The compiled readers of the fast scan against the exact path's regexes, on generated text
made of the pieces they look for (rank words, `global_`, brackets, digits, separators)."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from logtriage.demux import prefix_shapes
from logtriage.demux.line_marks import find_rank_marker
from logtriage.demux.split import split_glued
from logtriage.fastscan import kernel_markers, kernel_prefixes
from logtriage.fastscan.kernel_lines import bare_glued

PIECES = ["rank", "Rank", "RANK", "global_", "global ", "Global", "[", "]", ":", "=", "#", "|", ",",
          "(", ")", ">", "/", " ", "  ", "0", "7", "12", "123456789", "1234567890", "123456789012", "1234567890123", "x", "step 3", "]:", "default",
          " step", " done", "iter", "ation", "Loss", "é", "…", "_", "per", " per ", "Per", "super", " and", " To",
          " task", " re-", "or", " vs", "With", " 9x", " failed", " IS", " hung"]
texts = st.lists(st.sampled_from(PIECES), max_size=8).map("".join)
# Prefix-shaped text: `[` word digits `]` separator rest, where the word and digit counts straddle
# the limits the readers enforce (12 digits for `[rankN]:`, 7 for a tee role, 9 for a marker).
DIGITS = st.integers(min_value=1, max_value=14).map(lambda n: "1234567890123456"[:n])
shaped = st.builds(lambda open_, word, digits, close, rest: open_ + word + digits + close + rest,
                   st.sampled_from(["[", "", " "]), st.sampled_from(["rank", "Rank", "default", "trainer", "global_rank",
                                                                  "rank ", "rank=", "gpu-"]),
                   DIGITS, st.sampled_from(["]:", "]: ", "]:[", "]", ":", " |", "] ", "/8]", "/4: ", " / 12 |", "/4 step",
                                            "/ x", "/123456789012:"]), texts)

# a logging format's time, then a rank field (`2026-12-03T11:19:07.145+00:00 rank2 INFO`, `1796297283.230 r0 INFO`)
stamped = st.builds(lambda stamp, word, digits, after, rest: stamp + word + digits + after + rest,
                    st.sampled_from(["2026-12-03T11:19:07.145+00:00 ", "1796297283.230 ", "11:18:28.879 ", "[12:00:01] ",
                                     "2026-12-03 11:19:07,1 ", "12 ", "1:2:3 ", "2026-12-03 11:19:07 running ", ""]),
                    st.sampled_from(["rank", "r", "Rank ", "R", "rank=", "ra"]), DIGITS,
                    st.sampled_from([" INFO", " info", ":", " |", " step", " x", "", " ERRORS"]), texts)

# a logging format's level, maybe a logger's name, then the script's own `rank N: ` (`INFO vqvae: rank 2: ...`)
leveled = st.builds(lambda level, name, word, digits, after, rest: level + name + word + digits + after + rest,
                    st.sampled_from(["INFO ", "ERROR ", "[WARNING] ", "info ", "x ", "", "2026-12-05 15:39:51,756 INFO "]),
                    st.sampled_from(["vqvae: ", "a.b: ", "vqvae:", ": ", "vqvae ", ""]),
                    st.sampled_from(["rank ", "rank", "Rank ", "ra"]), DIGITS,
                    st.sampled_from([": ", ":", " step", ""]), texts)


def _buf(text: str) -> np.ndarray:
    return np.frombuffer(text.encode(), dtype=np.uint8)


@settings(max_examples=5000, deadline=None)
@given(texts | shaped | stamped | leveled)
@example("é|rank:0")
def test_rank_marker_matches_the_exact_path(text):
    buf = _buf(text)   # the kernel reads bytes: a non-ASCII character is more than one (`é|rank:0`)
    found = kernel_markers.marker(buf, 0, len(buf), np.empty(8, dtype=np.int64))
    if found == -2:
        return   # more than 8 "rank" words: the fast scan hands the line to the exact path
    expected = find_rank_marker(text)
    assert (found if found >= 0 else None) == expected, text


@settings(max_examples=2000, deadline=None)
@given(texts | shaped)
def test_excepthook_and_tee_prefixes_match_the_exact_path(text):
    buf = _buf(text)
    rank, after = kernel_prefixes.excepthook(buf, 0, len(buf))
    m = prefix_shapes.EXCEPTHOOK.match(text)
    assert (rank, after) == ((int(m.group(1)), m.end()) if m else (-1, -1)), text
    local, after = kernel_prefixes.tee(buf, 0, len(buf))
    m = prefix_shapes.TEE.match(text)
    expected = (int(m.group(2)), m.end()) if m and m.group(1) != "rank" else (-1, -1)
    assert (local, after) == expected, text


STAMP_PIECES = ["2023", "-", "05", "26", "T", "16", ":", "48", "07", ".", "093268664", "1234567890", "Z", "+",
                "02", "0200", " ", ": ", "x", "1"]
stamps = st.builds(lambda date, fraction, zone, close, rest: date + fraction + zone + close + rest,
                   st.sampled_from(["2023-05-26T16:48:07", "2023-05-26T16:48:7", "202-05-26T16:48:07", ""]),
                   st.sampled_from(["", ".1", ".093268664", ".1234567890", "."]),
                   st.sampled_from(["Z", "+02:00", "-0500", "+020", "+02:0", "+2:00", "", "z"]),
                   st.sampled_from([" ", ": ", ":", ""]),
                   st.lists(st.sampled_from(STAMP_PIECES), max_size=4).map("".join))


@settings(max_examples=3000, deadline=None)
@given(stamps | st.lists(st.sampled_from(STAMP_PIECES), max_size=12).map("".join))
def test_collector_stamp_matches_the_exact_path(text):
    after = kernel_prefixes.collector_stamp(_buf(text), 0, len(text.encode()))
    m = prefix_shapes.COLLECTOR_STAMP.match(text)
    assert after == (m.end() if m else -1), text


GLUED_PIECES = ["rank ", "rank", "Rank ", "1", "12", "1234567", "0.125", ")", "]", "%", "x", " ", ":", "/", " step 0",
                " loss 1.1", ": ERROR drift", "local_", "_"]
glued_texts = st.lists(st.sampled_from(GLUED_PIECES), min_size=1, max_size=10).map("".join)


@settings(max_examples=1500, deadline=None)
@given(glued_texts)
@example("rank 1 step 0 loss 1.1142 p_acc 0.125rank 2: ERROR station HRV clock drift")
@example("rank 1 waits for rank 2 to send its shard")
@example("rank 1 local_rank 0 device cpu")
def test_bare_glued_flags_every_line_the_exact_split_cuts_there(text):
    # the fast path may send more lines to the exact path than split.py cuts, never fewer
    buf = np.frombuffer(text.encode(), dtype=np.uint8)
    if text.startswith("rank ") and any(piece.startswith("rank ") for piece in split_glued(text)[1:]):
        assert bare_glued(buf, 0, buf.shape[0])
