"""Rank sets written as ranges, for reports and reasons alike."""

from __future__ import annotations

from typing import Iterable


def ranges(ranks: Iterable[int], limit: int | None = None) -> str:
    """0,1,2,3,5 -> '0–3, 5'; with `limit`, at most that many parts and then '…'."""
    parts, start, prev = [], None, None
    for r in sorted(set(ranks)):
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            parts.append(f"{start}" if start == prev else f"{start}–{prev}")
            start = prev = r
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}–{prev}")
    if limit is not None and len(parts) > limit:
        parts = parts[:limit] + ["…"]
    return ", ".join(parts)
