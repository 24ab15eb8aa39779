"""Parse torchelastic's ChildFailedError block into entries (rank, exit code, signal, pid, time).

The block's own "Root Cause" is a heuristic (earliest failure at 1-second resolution, ties to
the lowest local rank) and is often wrong; it is kept as one piece of evidence."""

from __future__ import annotations

import re
from dataclasses import dataclass

from logtriage.analysis.timestamps import Stamp, parse_cfe_time
from logtriage.demux.blocks import EXCEPTION_HEAD
from logtriage.demux.frames import COLLECTIVE_FRAME, FRAME
from logtriage.demux.launcher import CFE_EXIT, CFE_RANK, MPI_NOTICE, MPI_NOTICE_SIGNAL, is_cfe_start

# The rank and exitcode fields are read with the demuxer's own patterns (at most 12 digits: a
# log cannot make an integer too big for the JSON report or too long to convert).
_ENTRY = re.compile(r"^\[(\d{1,12})\]:\s*$")
_FIELD = re.compile(r"^\s{1,4}(time|host|rank|exitcode|error_file|traceback)\s*: ?(.*)$")


@dataclass(frozen=True)
class ChildFailure:
    index: int
    rank: int | None
    local_rank: int | None
    exitcode: int | None
    pid: int | None
    signal: str | None
    time: Stamp | None
    traceback: str
    is_root_cause: bool
    source: int
    line: int            # the entry's `exitcode` line (or its `[i]:` line)
    exception: str = ""  # the worker's exception, from the error file the `traceback :` field shows
    exception_line: int | None = None
    message: str = ""    # the lines after that exception line (a multi-line message, NCCL's `Last error:`)
    collective: str = ""  # the c10d function the error file's traceback was in (barrier, all_reduce)
    last_frame: str = ""  # that traceback's innermost function


MESSAGE_LINES = 4   # how many lines after an error file's exception line still belong to its message


def parse_child_failures(launcher_lines: list[tuple[int, int, str]]) -> list[ChildFailure]:
    """Entries of every ChildFailedError block (the last attempt's is last)."""
    entries: list[ChildFailure] = []
    in_root = False
    current: dict | None = None
    notice: dict | None = None
    for source, number, text in launcher_lines:
        m = MPI_NOTICE.match(text)
        signal = MPI_NOTICE_SIGNAL.match(text) if notice is not None and m is None else None
        if m or signal:
            if m:
                notice = {"index": len(entries), "root": not any(e.is_root_cause for e in entries),
                          "rank": int(m.group(1)), "pid": int(m.group(2)), "source": source, "line": number}
            number_text = m.group(3) if m else signal.group(1)
            if number_text is not None:
                notice["exitcode"] = -int(number_text)
                notice["signal"] = SIGNALS.get(int(number_text))
                notice["line"] = number
                _flush(notice, entries)
                notice = None
            continue
        notice = None
        if is_cfe_start(text):
            in_root = False
        if text.startswith("Root Cause"):
            _flush(current, entries)
            current = None
            in_root = True
            continue
        if text.startswith("Failures:"):
            in_root = False
            continue
        m = _ENTRY.match(text)
        if m:
            _flush(current, entries)
            current = {"index": int(m.group(1)), "root": in_root, "source": source, "line": number}
            continue
        if current is not None and "traceback" in current:
            # the error file's traceback, indented under the field; its last exception line is the worker's
            if text.startswith("  ") and not _FIELD.match(text):
                if EXCEPTION_HEAD.match(text.strip()):
                    current["exception"], current["exception_line"] = text.strip(), number
                    current["message"] = ""
                elif "exception" in current and current["message"].count("\n") < MESSAGE_LINES:
                    current["message"] += text.strip() + "\n"
                elif (frame := FRAME.match(text)) is not None:
                    current["last_frame"] = frame.group(3)
                    if (collective := COLLECTIVE_FRAME.search(text)) is not None:
                        current["collective"] = collective.group(1)
                continue
            _flush(current, entries)
            current = None
        m = _FIELD.match(text)
        if m and current is None and m.group(1) == "time":
            # an entry whose `[i]:` header the paste cut off: its fields still name the worker
            current = {"index": len(entries), "root": in_root or not entries, "source": source, "line": number}
        if current is None or not m:
            continue
        name, value = m.group(1), m.group(2).rstrip()
        if name == "rank":
            r = CFE_RANK.match(text)
            if r:
                current["rank"], current["local_rank"] = int(r.group(1)), int(r.group(2))
        elif name == "exitcode":
            e = CFE_EXIT.match(text)
            if e:
                current["exitcode"], current["pid"] = int(e.group(1)), int(e.group(2))
                current["signal"] = e.group(3)
                current["line"] = number
        elif name == "time":
            current["time"] = parse_cfe_time(value)
        elif name == "traceback":
            current["traceback"] = value
            if not value.startswith("Traceback"):
                _flush(current, entries)
                current = None
    _flush(current, entries)
    return entries


def _flush(current: dict | None, entries: list[ChildFailure]) -> None:
    if current is None or "exitcode" not in current:
        return
    entries.append(ChildFailure(
        index=current["index"], rank=current.get("rank"), local_rank=current.get("local_rank"),
        exitcode=current.get("exitcode"), pid=current.get("pid"), signal=current.get("signal"),
        time=current.get("time"), traceback=current.get("traceback", ""), is_root_cause=current["root"],
        source=current["source"], line=current["line"], exception=current.get("exception", ""),
        exception_line=current.get("exception_line"), message=current.get("message", ""),
        collective=current.get("collective", ""), last_frame=current.get("last_frame", "")))


SIGNALS = {1: "SIGHUP", 2: "SIGINT", 3: "SIGQUIT", 4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE",
           9: "SIGKILL", 11: "SIGSEGV", 13: "SIGPIPE", 15: "SIGTERM"}


def signal_name(exitcode: int | None) -> str | None:
    """-9 -> SIGKILL; also shells' 128+N codes (137 -> SIGKILL)."""
    if exitcode is None:
        return None
    if exitcode < 0:
        return SIGNALS.get(-exitcode, f"signal {-exitcode}")
    if 128 < exitcode < 160 and exitcode - 128 in SIGNALS:
        return SIGNALS[exitcode - 128]
    return None


def is_own_failure(exitcode: int | None) -> bool:
    """A worker's exit that is its own failure: not 0, and not the SIGTERM the agent sends to stop
    the others (-15, or 143 from a shell)."""
    return exitcode not in (None, 0) and signal_name(exitcode) != "SIGTERM"


def is_killed(exitcode: int | None) -> bool:
    """Ended from outside: SIGTERM or SIGKILL, as the launcher (-N) or a shell (128+N) reports it."""
    return signal_name(exitcode) in ("SIGTERM", "SIGKILL")
