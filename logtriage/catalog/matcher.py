"""Match cleaned log lines against the whole catalog at once.

All RE2 patterns go into one RE2::Set, so a line costs one scan whatever the number of rules;
only the rules whose patterns hit are then searched again for their named captures. Rules on the
`regex` engine (user rules with look-around) are tried one by one under their time limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import re2

from logtriage.catalog.compiled import CompiledRule
from logtriage.catalog.loader import Catalog
from logtriage.catalog.rule import Engine, Rule
from logtriage.errors import CatalogError

SET_MAX_MEM = 256 << 20      # RE2's default (8 MB) fails to build a set of ~1,500 patterns


@dataclass(frozen=True)
class RuleHit:
    rule: Rule
    captures: Mapping[str, str]


class Matcher:
    def __init__(self, catalog: Catalog):
        self._rules = [c for c in catalog.rules if c.rule.patterns]
        options = re2.Options()
        options.max_mem = SET_MAX_MEM
        self._set = re2.Set.SearchSet(options)
        self._owner: list[CompiledRule] = []
        self._slow: list[CompiledRule] = []
        for compiled in self._rules:
            if compiled.engine is Engine.RE2:
                for pattern in compiled.rule.patterns:
                    self._set.Add(pattern)
                    self._owner.append(compiled)
            else:
                self._slow.append(compiled)
        self._empty = not self._owner
        if not self._empty:
            try:
                self._set.Compile()
            except re2.error as exc:
                raise CatalogError(f"the catalog's {len(self._owner)} patterns do not compile together "
                                   f"within RE2's {SET_MAX_MEM >> 20} MB: {exc}") from None

    @property
    def rules(self) -> list[CompiledRule]:
        return self._rules

    def match(self, text: str) -> list[RuleHit]:
        """Every rule that matches `text`, highest priority first (ties by id)."""
        hits: dict[str, RuleHit] = {}
        if not self._empty:
            for index in self._set.Match(text) or ():
                compiled = self._owner[index]
                if compiled.rule.id in hits:
                    continue
                captures = compiled.search(text)
                if captures is not None:
                    hits[compiled.rule.id] = RuleHit(compiled.rule, captures)
        for compiled in self._slow:
            captures = compiled.search(text)
            if captures is not None:
                hits[compiled.rule.id] = RuleHit(compiled.rule, captures)
        return _by_priority(hits.values())

    def timed_out_rules(self) -> list[str]:
        return [c.rule.id for c in self._slow if c.timed_out]


def match_line(catalog: Catalog, text: str) -> list[RuleHit]:
    """Every rule matching one line, highest priority first, without building the pattern set:
    for the few lines the analysis reads back (an error file's exception in a launcher summary)."""
    return _by_priority(RuleHit(c.rule, captures) for c in catalog.rules
                        if c.rule.patterns and (captures := c.search(text)) is not None)


def _by_priority(hits) -> list[RuleHit]:
    """Highest priority first, ties by id."""
    return sorted(hits, key=lambda h: (-h.rule.priority, h.rule.id))
