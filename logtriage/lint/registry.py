"""All lint rules, looked up by id or slug, and the link to the runtime catalog.

The interface `triage explain` uses: `all_rules()`, `get_rule(id)`, `rules_preventing(runtime_id)`,
and `LintRule.describe()` for plain data.
"""

from __future__ import annotations

from functools import lru_cache

from logtriage.errors import UsageError
from logtriage.lint.model import LintRule


@lru_cache(maxsize=1)
def all_rules() -> tuple[LintRule, ...]:
    from logtriage.lint import rules_ckpt, rules_collective, rules_data, rules_setup, rules_templates

    rules = (*rules_collective.RULES, *rules_data.RULES, *rules_setup.RULES, *rules_ckpt.RULES,
             *rules_templates.RULES)
    ids = [r.id for r in rules]
    names = [r.name for r in rules]
    if len(set(ids)) != len(ids) or len(set(names)) != len(names):
        raise RuntimeError("duplicate lint rule id or name")
    return tuple(sorted(rules, key=lambda r: r.id))


def get_rule(rule_id: str) -> LintRule | None:
    """A rule by id (`DDP101`, any case) or slug name (`collective-in-rank-branch`)."""
    key = rule_id.strip()
    for rule in all_rules():
        if rule.id == key.upper() or rule.name == key.lower():
            return rule
    return None


def rules_preventing(runtime_rule_id: str) -> tuple[LintRule, ...]:
    """Lint rules whose findings, fixed, prevent the failure a catalog rule reports."""
    return tuple(r for r in all_rules() if runtime_rule_id in r.prevents)


def rules_linked(runtime_rule_id: str) -> tuple[LintRule, ...]:
    """Lint rules that prevent the failure or make it diagnosable (the wider link)."""
    return tuple(r for r in all_rules() if runtime_rule_id in r.prevents or runtime_rule_id in r.helps_diagnose)


def select_rules(select: list[str] | None = None, ignore: list[str] | None = None) -> tuple[LintRule, ...]:
    """Rules chosen by `--select`/`--ignore` codes: a full id, an id prefix (`CKP`, `DDP1`), a slug
    name, or ALL. Unknown codes are a usage error, so a typo does not silently select nothing."""
    chosen = [r for r in all_rules() if not select or any(_matches(r, code) for code in select)]
    if ignore:
        chosen = [r for r in chosen if not any(_matches(r, code) for code in ignore)]
    for code in [*(select or []), *(ignore or [])]:
        if not any(_matches(r, code) for r in all_rules()):
            raise UsageError(f"unknown lint rule or prefix '{code}' (see `triage lint --list-rules`)")
    return tuple(chosen)


def _matches(rule: LintRule, code: str) -> bool:
    code = code.strip()
    return code.upper() == "ALL" or rule.id.startswith(code.upper()) or rule.name == code.lower()
