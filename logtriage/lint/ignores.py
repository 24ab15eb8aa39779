"""Suppression comments.

    x = dist.all_reduce(t)   # triage: ignore[DDP101]      silence DDP101 on this line
    torch.save(s, p)         # triage: ignore              silence every rule on this line
    # triage: ignore-file[LNC401]                           silence LNC401 in the whole file

Codes are rule ids or slug names, comma-separated. In Python files only real comments count (a
string that contains the text does not); in templates any `#` comment does.
"""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass, field

from logtriage.lint.model import Finding

PRAGMA = re.compile(r"#\s*triage:\s*ignore(?P<file>-file)?(?:\[(?P<codes>[^\]]*)\])?", re.I)
ALL = frozenset({"*"})


@dataclass(frozen=True)
class Suppressions:
    lines: dict[int, frozenset[str]] = field(default_factory=dict)   # line -> lower-case codes, "*" = all
    whole_file: frozenset[str] = frozenset()

    def silences(self, finding: Finding) -> bool:
        codes = self.lines.get(finding.line, frozenset()) | self.whole_file
        return "*" in codes or finding.rule_id.lower() in codes or finding.rule_name in codes


def _codes(match: re.Match) -> frozenset[str]:
    if match.group("codes") is None:
        return ALL
    return frozenset(c.strip().lower() for c in match.group("codes").split(",") if c.strip())


def _collect(comments: list[tuple[int, str]]) -> Suppressions:
    lines: dict[int, frozenset[str]] = {}
    whole: frozenset[str] = frozenset()
    for number, text in comments:
        for match in PRAGMA.finditer(text):
            if match.group("file"):
                whole |= _codes(match)
            else:
                lines[number] = lines.get(number, frozenset()) | _codes(match)
    return Suppressions(lines, whole)


def python_suppressions(text: str) -> Suppressions:
    if "triage:" not in text:
        return Suppressions()
    comments: list[tuple[int, str]] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                comments.append((tok.start[0], tok.string))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        comments = [(n, line[line.index("#"):]) for n, line in enumerate(text.splitlines(), 1) if "#" in line]
    return _collect(comments)


def template_suppressions(text: str) -> Suppressions:
    return _collect([(n, line[line.index("#"):]) for n, line in enumerate(text.splitlines(), 1) if "#" in line])
