"""`triage catalog check`: ids unique, fields present, patterns compile, every example behaves."""

from __future__ import annotations

from logtriage.catalog.loader import Catalog
from logtriage.catalog.rule import DOC_FIELDS, Rule


def check_catalog(catalog: Catalog, require_docs: bool = True) -> list[str]:
    """All problems: the loader's plus each rule's documentation and examples."""
    problems = list(catalog.problems)
    aliases: dict[str, str] = {}
    ids = {compiled.rule.id for compiled in catalog.rules}
    for compiled in catalog.rules:
        rule = compiled.rule
        where = f"{rule.path}: {rule.id}"
        if require_docs:
            problems += [f"{where}: missing '{f}'" for f in DOC_FIELDS if not _has(rule, f)]
            if not rule.derived and not rule.examples:
                problems.append(f"{where}: no [[examples]]")
        problems += [f"{where}: recovered_by names no rule '{other}'" for other in rule.recovered_by
                     if other not in ids]
        for alias in rule.aliases:
            key = alias.lower()
            if key in aliases and aliases[key] != rule.id:
                problems.append(f"{where}: alias '{alias}' also used by {aliases[key]}")
            aliases[key] = rule.id
        for example in rule.examples:
            captures = compiled.search(example.line)
            if captures is None:
                problems.append(f"{where}: example does not match: {example.line[:120]!r}")
                continue
            for name, expected in example.captures.items():
                if captures.get(name) != expected:
                    problems.append(
                        f"{where}: example capture '{name}' is {captures.get(name)!r}, expected {expected!r}")
        for counter in rule.counterexamples:
            if compiled.search(counter.line) is not None:
                problems.append(f"{where}: counterexample matches: {counter.line[:120]!r}")
    return problems


def _has(rule: Rule, field: str) -> bool:
    value = getattr(rule, field)
    return bool(value) if not isinstance(value, tuple) else len(value) > 0
