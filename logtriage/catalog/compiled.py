"""Compiled patterns of one rule: RE2 (linear time) or, for user rules that need look-around or
backreferences, the `regex` module with a per-call time limit so a pathological rule cannot stall
a triage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import re2
import regex

from logtriage.catalog.rule import Engine, Rule

# A look-around rule gets this long per line before the line counts as "no match" and the
# rule is marked as having timed out; after MAX_TIMEOUTS such lines it is switched off for the
# rest of the process (the report says so), so a pathological rule costs at most ~0.15 s.
REGEX_TIMEOUT_S = 0.05
MAX_TIMEOUTS = 3
MAX_DIGITS = 18       # every number of up to 18 digits fits the JSON report's 64-bit integers
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.max_mem = 64 << 20
_RE2_OPTIONS.log_errors = False   # a rule that does not compile is reported once, not logged by RE2 on stderr


class PatternError(ValueError):
    def __init__(self, index: int, pattern: str, message: str):
        self.index = index
        self.pattern = pattern
        super().__init__(message)


@dataclass
class CompiledRule:
    rule: Rule
    engine: Engine
    _search: tuple[Callable, ...]
    timed_out: int = 0

    @property
    def disabled(self) -> bool:
        return self.timed_out >= MAX_TIMEOUTS

    def search(self, text: str) -> dict[str, str] | None:
        """Captures of the first pattern that matches `text` (empty dict if no groups), or None."""
        for search in self._search:
            if self.timed_out >= MAX_TIMEOUTS:
                return None
            try:
                m = search(text)
            except TimeoutError:
                self.timed_out += 1
                continue
            if m is not None:
                return {k: v for k, v in m.groupdict().items() if v is not None and not _absurd_number(v)}
        return None


def _absurd_number(value: str) -> bool:
    """A capture of more than MAX_DIGITS digits is no rank, pid, exit code or size a fact can use
    (int() refuses 4300 digits, JSON 64 bits): it is dropped, the line's other facts stay."""
    return len(value) > MAX_DIGITS and value.lstrip("-").isdigit()


def compile_rule(rule: Rule, allow_fallback: bool) -> CompiledRule:
    """Compile every pattern; RE2 unless the rule asks for `regex` or (user rules only) RE2
    cannot express it. Raises PatternError naming the first pattern that fails."""
    engine = rule.engine
    if engine is Engine.RE2:
        try:
            return CompiledRule(rule, Engine.RE2, tuple(_re2(i, p) for i, p in enumerate(rule.patterns)))
        except PatternError:
            if not allow_fallback:
                raise
    return CompiledRule(rule, Engine.REGEX, tuple(_regex(i, p) for i, p in enumerate(rule.patterns)))


def _re2(index: int, pattern: str) -> Callable:
    try:
        return re2.compile(pattern, _RE2_OPTIONS).search
    except re2.error as exc:
        raise PatternError(index, pattern, f"pattern {index + 1} does not compile with RE2: {exc}") from None


def _regex(index: int, pattern: str) -> Callable:
    try:
        compiled = regex.compile(pattern)
    except regex.error as exc:
        raise PatternError(index, pattern, f"pattern {index + 1} does not compile: {exc}") from None

    def search(text: str):
        return compiled.search(text, timeout=REGEX_TIMEOUT_S)

    return search
