"""Occurrence counts by category or rule over time, with pandas (imported here only).

    table = occurrence_stats(rows, by="category", period="week")
    table.to_csv("stats.csv", index=False)      # or .to_parquet(...) with pyarrow

The long table has one row per (period, key): `period` (the period's first day), `key` (the
category or rule id), `occurrences`, `incidents` (distinct incidents seen), `open_incidents`.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Sequence

from logtriage.errors import TriageError, UsageError

if TYPE_CHECKING:
    import pandas as pd

BY = {"category": "category", "rule": "rule_id"}
PERIODS = {"day": "D", "week": "W-SUN", "month": "M"}     # weeks start on Monday, end on Sunday
COLUMNS = ["period", "key", "occurrences", "incidents", "open_incidents"]


def occurrence_stats(rows: Sequence[tuple[datetime, int, str, str, str]], by: str = "category",
                     period: str = "week") -> "pd.DataFrame":
    """rows: (added_at, incident_id, rule_id, category, incident status), as the store gives them."""
    import pandas as pd
    if by not in BY:
        raise UsageError(f"--by takes {', '.join(BY)} (got {by!r})")
    if period not in PERIODS:
        raise UsageError(f"--period takes {', '.join(PERIODS)} (got {period!r})")
    frame = pd.DataFrame(list(rows), columns=["added_at", "incident_id", "rule_id", "category", "status"])
    if frame.empty:
        return pd.DataFrame({c: pd.Series(dtype=t) for c, t in
                             zip(COLUMNS, ["datetime64[ns]", "object", "int64", "int64", "int64"])})
    added = pd.to_datetime(frame["added_at"], utc=True).dt.tz_convert(None)
    frame["period"] = added.dt.to_period(PERIODS[period]).dt.start_time
    frame["key"] = frame[BY[by]]
    frame["open_incident"] = frame["incident_id"].where(frame["status"] == "open")
    table = (frame.groupby(["period", "key"], sort=True)
             .agg(occurrences=("incident_id", "size"), incidents=("incident_id", "nunique"),
                  open_incidents=("open_incident", "nunique"))
             .reset_index())
    return table[COLUMNS].astype({"occurrences": "int64", "incidents": "int64", "open_incidents": "int64"})


def pivot_text(table: "pd.DataFrame", period: str) -> str:
    """Periods down, keys across, occurrence counts in the cells, a total row and column."""
    if table.empty:
        return "no occurrences recorded\n"
    import pandas as pd
    grid = table.pivot_table(index="period", columns="key", values="occurrences", aggfunc="sum", fill_value=0)
    grid = grid[grid.sum().sort_values(ascending=False).index]
    grid["total"] = grid.sum(axis=1)
    grid.loc["total"] = grid.sum(axis=0)
    fmt = {"day": "%Y-%m-%d", "week": "%Y-%m-%d", "month": "%Y-%m"}[period]
    grid.index = [i if isinstance(i, str) else pd.Timestamp(i).strftime(fmt) for i in grid.index]
    grid.index.name = f"{period} of"
    grid.columns.name = None
    return grid.to_string() + "\n"


def write_table(table: "pd.DataFrame", csv: str | None = None, parquet: str | None = None) -> None:
    try:
        if csv:
            table.to_csv(csv, index=False, date_format="%Y-%m-%d")
        if parquet:
            try:
                import pyarrow  # noqa: F401  (pandas needs it for Parquet)
            except ImportError as exc:
                raise TriageError("Parquet export needs pyarrow: pip install 'logtriage[parquet]'") from exc
            table.to_parquet(parquet, index=False)
    except OSError as exc:
        raise UsageError(f"cannot write {csv or parquet}: {exc}") from exc
