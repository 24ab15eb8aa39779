"""Timestamps found at the start of log lines, as seconds since the start of their year.

Formats: py-glog `E0424 01:11:21.160832 pid file:line]` (no year), C++ glog
`[E0424 01:11:21.160832123 file:line]` (no year; NOT monotonic within a process: the seconds
and the fraction come from different reads, so only whole seconds are trusted), Python
logging / ISO `2026-11-30 00:01:41,740` or `2026-11-30T00:01:41.740Z`, DeepSpeed
`[2025-01-16 16:17:48,379]`, ChildFailedError `2026-11-29_23:34:30`, syslog/dmesg-like
`Nov 30 00:01:41`, a script's epoch seconds `1796296783.691` and a bare time of day `11:18:28.879`.
Without a year, all stamps of one log are assumed to share one. Epoch seconds (UTC, where the others
are local time) and a bare time of day (no date) are compared only with their own kind."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

_GLOG = re.compile(r"^\[?[IWEFC](\d{1,2})(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{3,9})")
_ISO = re.compile(r"^\[?(\d{4})-(\d\d)-(\d\d)[ T_](\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?")
_MONTHS = {m: i for i, m in enumerate("Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split(), 1)}
_SYSLOG = re.compile(r"^(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) +(\d{1,2}) (\d\d):(\d\d):(\d\d)")
# `time.time()` printed with its fraction (2001-09-09 to 2039-09-07), and a time of day alone
_EPOCH = re.compile(r"^\[?(1\d{9}|20\d{8}|21\d{8})\.(\d{1,9})(?=[\s\]])")
_CLOCK = re.compile(r"^\[?(\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?(?=[\s\]])")
ISOLATED_FAMILIES = frozenset({"epoch", "clock"})
_DAYS_BEFORE = (0, 0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334)


@dataclass(frozen=True, slots=True)
class Stamp:
    seconds: float        # since Jan 1 of the (assumed common) year
    precision: float      # seconds: 1.0 when only whole seconds can be trusted
    family: str           # "glog", "cpp-glog", "iso"


def parse_stamp(text: str) -> Stamp | None:
    """The timestamp a line starts with, if any (prefixes already stripped)."""
    if not text:
        return None
    first = text[0]
    if first in "IWEFC[":
        m = _GLOG.match(text)
        if m:
            month, day, hh, mm, ss, frac = m.groups()
            cpp = first == "["
            base = _seconds(int(month), int(day), int(hh), int(mm), int(ss))
            if base is None:
                return None
            if cpp:
                return Stamp(base, 1.0, "cpp-glog")
            return Stamp(base + int(frac) / 10 ** len(frac), 0.001, "glog")
    if first.isdigit() or first == "[":
        m = _ISO.match(text)
        if m:
            year, month, day, hh, mm, ss, frac = m.groups()
            base = _seconds(int(month), int(day), int(hh), int(mm), int(ss))
            if base is None:
                return None
            fraction = int(frac) / 10 ** len(frac) if frac else 0.0
            return Stamp(base + fraction, 0.001 if frac else 1.0, "iso")
        m = _EPOCH.match(text)
        if m:
            frac = m.group(2)
            return Stamp(int(m.group(1)) + int(frac) / 10 ** len(frac), 0.001, "epoch")
        m = _CLOCK.match(text)
        if m:
            hh, mm, ss, frac = m.groups()
            if int(hh) >= 24 or int(mm) >= 60 or int(ss) >= 61:
                return None
            fraction = int(frac) / 10 ** len(frac) if frac else 0.0
            return Stamp(int(hh) * 3600 + int(mm) * 60 + int(ss) + fraction, 0.001 if frac else 1.0, "clock")
    if first in "JFMASOND":
        m = _SYSLOG.match(text)
        if m:
            base = _seconds(_MONTHS[m.group(1)], int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5)))
            return Stamp(base, 1.0, "syslog") if base is not None else None
    return None


def parse_cfe_time(value: str) -> Stamp | None:
    """The ChildFailedError `time      : 2026-11-29_23:34:30` value (1-second resolution)."""
    m = _ISO.match(value.strip())
    if not m:
        return None
    _, month, day, hh, mm, ss, _ = m.groups()
    base = _seconds(int(month), int(day), int(hh), int(mm), int(ss))
    return Stamp(base, 1.0, "iso") if base is not None else None


def _seconds(month: int, day: int, hh: int, mm: int, ss: int) -> float | None:
    if not (1 <= month <= 12 and 1 <= day <= 31 and hh < 24 and mm < 60 and ss < 61):
        return None
    return float(((_DAYS_BEFORE[month] + day - 1) * 24 + hh) * 3600 + mm * 60 + ss)


def clearly_before(a: Stamp | None, b: Stamp | None) -> bool | None:
    """True/False when the stamps order the two events beyond their precision, else None."""
    if a is None or b is None:
        return None
    if a.family != b.family and (a.family in ISOLATED_FAMILIES or b.family in ISOLATED_FAMILIES):
        return None
    margin = max(a.precision, b.precision)
    if a.seconds + margin <= b.seconds:
        return True
    if b.seconds + margin <= a.seconds:
        return False
    return None


def to_datetime_text(stamp: Stamp) -> str:
    """For display only: MM-DD HH:MM:SS.mmm (the year is not known from glog stamps)."""
    day_of_year = int(stamp.seconds // 86400)
    month = max(m for m in range(1, 13) if _DAYS_BEFORE[m] <= day_of_year)
    day = day_of_year - _DAYS_BEFORE[month] + 1
    rest = stamp.seconds - day_of_year * 86400
    return datetime(2000, month, min(day, 28) if month == 2 else day).strftime("%m-%d") + \
        " %02d:%02d:%06.3f" % (rest // 3600, rest % 3600 // 60, rest % 60)
