"""What the log view lists: a sequence of line ids (gids) with a title. The view of every line
is a range, never materialised, so a 10-million-line log costs nothing to show."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np


class Mode(str, Enum):
    ALL = "all"            # every line, input order (before the triage finishes, and with `m`)
    STREAM = "stream"      # one stream (a rank, the launcher ...)
    SPLIT = "split"        # two streams side by side


@dataclass(frozen=True)
class View:
    title: str
    count: int
    gids: np.ndarray | None = None          # None: gids 0..count-1
    ordered: bool = True                    # gids ascending (input order)
    _inverse: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def every_line(cls, title: str, total: int) -> "View":
        return cls(title, total)

    @classmethod
    def of(cls, title: str, gids: np.ndarray, ordered: bool = True) -> "View":
        return cls(title, len(gids), np.asarray(gids, np.int64), ordered)

    def gid(self, row: int) -> int:
        return row if self.gids is None else int(self.gids[row])

    def row_of(self, gid: int) -> int | None:
        """The row showing a line, or None when the view leaves it out."""
        if self.gids is None:
            return gid if 0 <= gid < self.count else None
        if self.ordered:
            row = int(np.searchsorted(self.gids, gid))
            return row if row < self.count and int(self.gids[row]) == gid else None
        order = self._order()
        pos = int(np.searchsorted(self.gids[order], gid))
        return int(order[pos]) if pos < self.count and int(self.gids[order[pos]]) == gid else None

    def rows_of(self, gids: np.ndarray) -> np.ndarray:
        """Rows (ascending) of those of `gids` (ascending) that the view shows."""
        gids = np.asarray(gids, np.int64)
        if self.gids is None:
            return gids[(gids >= 0) & (gids < self.count)]
        if self.ordered:
            pos = np.searchsorted(self.gids, gids)
            ok = pos < self.count
            pos, gids = pos[ok], gids[ok]
            return pos[self.gids[pos] == gids]
        return np.flatnonzero(np.isin(self.gids, gids))

    def subset(self, title: str, gids: np.ndarray) -> "View":
        """The lines of this view that are also in `gids` (ascending), in this view's order."""
        gids = np.asarray(gids, np.int64)
        if self.gids is None:
            return View.of(title, gids[(gids >= 0) & (gids < self.count)])
        return View(title, 0, self.gids[np.isin(self.gids, gids)], self.ordered)._counted()

    def all_gids(self) -> np.ndarray:
        return np.arange(self.count, dtype=np.int64) if self.gids is None else self.gids

    def _counted(self) -> "View":
        return View(self.title, len(self.gids), self.gids, self.ordered)

    def _order(self) -> np.ndarray:
        order = self._inverse.get("order")
        if order is None:
            order = np.argsort(self.gids, kind="stable")
            self._inverse["order"] = order
        return order
