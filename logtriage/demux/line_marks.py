"""What one line says by itself about where it belongs: a probe (`NAME_JSON={...}`), a rank marker in
its text (`[Rank 3]`, `rank=3`), the start of a multi-line block, and the pieces of a line that glued
two ranks' output together."""

from __future__ import annotations

import re

from logtriage.demux import blocks as B
from logtriage.demux.prefixes import Dialect, line_prefix_end
from logtriage.demux.split import split_glued

PROBE = re.compile(r"^([A-Z][A-Z0-9_]*_JSON)=(.*)$")
# a line's own time at its start: ISO or a time of day (with a fraction, a zone), or epoch seconds
_STAMP = (r"^\s*\[?(?:(?:\d{4}-\d\d-\d\d[ T_])?\d\d:\d\d:\d\d(?:[.,]\d{1,9})?(?:Z|[+-]\d\d:?\d\d)?"
          r"|\d{9,10}(?:\.\d{1,9})?)\]?")
_LEVELS = "INFO|WARNING|WARN|ERROR|DEBUG|CRITICAL|FATAL"
# a script's leading `rank N` and a word makes the line that rank's own (`rank 2 task 0 step 3 ...`, `rank 1 of 4
# ready`, `rank 2 re-evaluating all earlier tasks`), unless the word links it to more (`rank 0 and rank 1 ...`,
# `rank 2 to rank 3: ...`) or reports on it as another rank could (`rank 5 failed to pass the barrier`, `rank 3 is
# missing`, `rank 2 timed out`); the fast kernel reads the same
NOT_OWN_WORDS = ("and", "or", "to", "vs", "versus", "than", "with", "failed", "timed", "did", "is", "was", "has",
                 "had", "not", "never", "died", "crashed", "exited", "hung", "stalled", "lost", "missing")
# a script's own words naming its rank (`rank 3 ...`, `[rank 3] ...`, `RANK=3`, `rank_3`): where a line starts with
# it (.match), that rank wrote the line; found anywhere (.finditer), two ranks' lines glued into one split there
OWN_RANK = re.compile(r"\[?\b(?:rank|RANK|Rank)[ =:_]*(\d{1,6})\b")
# ASCII classes (`\b`, `\s`) as the fast-scan kernel reads bytes: `rank:0é` names rank 0 in both
_RANK_MARKERS = (
    # (`[rank 3]`, `[global_rank 3]`, `[rank: 3/8]`, and a logging format's `[<program> rank 3]`)
    re.compile(r"\[\s*(?:global[_ ]|[a-z][\w.-]{0,31} +)?rank\s*[:=#]?\s*(\d{1,9})\s*(?:/\s*\d+\s*)?\]",
               re.IGNORECASE | re.ASCII),
    # (not a count per rank: `too few identities per rank: 1 < P=4`)
    re.compile(r"(?:^|(?<!\bper)[\s,(|])(?:global_)?rank\s*[=:]\s*(\d{1,9})\b", re.IGNORECASE | re.ASCII),
    # and a script's own progress print or record that starts with its rank (`rank 3 step 12 loss 0.41`,
    # `rank 1 training finished`, `rank 1 WARNING uploader failed`, `rank 1/4: reading config`, `rank 2 trial 1
    # lr 0.1 step 1`, `rank 3 stage 1 sent`, `rank 0 config {...}`, `rank 2 resuming from ...`)
    re.compile(r"^\s*rank\s*(\d{1,9})(?:\s*/\s*\d+)?(?:\s*[:|\]]|\s+(?!(?:" + "|".join(NOT_OWN_WORDS) + r")\b)[a-z])",
               re.IGNORECASE | re.ASCII),
    # a logger's `(rank 2) message` and Megatron-style `> rank 2 ...` at the start of the message
    re.compile(r"^ *\( *rank *(\d{1,9}) *\)", re.IGNORECASE | re.ASCII),
    re.compile(r"^ *> *rank +(\d{1,9})\b", re.IGNORECASE | re.ASCII),
    # a logging format's `[%(levelname)s] rank 4: message`, behind the level's bracket, or a script's own
    # `ERROR rank 5: message` / `INFO rank 2: step 3` behind its bare level word, or behind the level and the
    # logger's name (`%(levelname)s %(name)s: %(message)s`: `INFO vqvae: rank 2: re-initialising dead codes`)
    re.compile(r"(?:\]|\b(?:ERROR|WARNING|WARN|INFO|DEBUG|CRITICAL|FATAL))(?:\s+[\w.]+:)?\s+rank ?(\d{1,9}): ",
               re.IGNORECASE | re.ASCII),
    # a logging format's rank field right after its time (`2026-12-03T11:19:07.145+00:00 rank2 INFO step 1`,
    # `1796297283.230 r0 INFO ...`, `11:18:28.879 rank3: ...`): `rN` only before a level word
    re.compile(_STAMP + r"\s+rank ?(\d{1,9})(?:\s*[:|]|\s+(?:" + _LEVELS + r"|step|epoch|iter|loss|batch)\b)",
               re.IGNORECASE | re.ASCII),
    re.compile(_STAMP + r"\s+r(\d{1,9})\s+(?:" + _LEVELS + r")\b", re.ASCII),
)


def pieces_of(line: str, dialect: Dialect) -> list[str]:
    """A physical line cut where a second rank's output was glued onto it; the labels a launcher
    puts on every line (srun, Open MPI, pdsh) stay on each piece, whose output they label."""
    head = line_prefix_end(line, dialect)
    if not head:
        return split_glued(line)
    return [line[:head] + piece for piece in split_glued(line[head:])]


def find_rank_marker(text: str) -> int | None:
    head = text[:120]
    for pattern in _RANK_MARKERS:
        m = pattern.search(head)
        if m:
            return int(m.group(1))
    return None


def block_start(text: str) -> B.BlockKind | None:
    if not text:
        return None
    first = text[0]
    if first == "T" and B.TRACEBACK_START.match(text):
        return B.BlockKind.TRACEBACK
    if first == "[" and B.CPP_GLOG.match(text):
        return B.BlockKind.CPP
    if first == "F" and B.FAULT_START.match(text):
        return B.BlockKind.FAULT
    if (first == "E" or first == "-") and B.IGNORED_START.match(text):
        return B.BlockKind.IGNORED
    if first == "t" and B.NATIVE_START.match(text):
        return B.BlockKind.NATIVE
    if B.WARNING_START.match(text):
        return B.BlockKind.WARNING
    return None
