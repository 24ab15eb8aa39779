"""Print a rule's documentation: what it means, the fix, the usual misdiagnosis.

    triage explain gloo.timeout
    triage explain E007 --format json        (error-manual ids are aliases)

Works for catalog rules and for lint rules; each shows the rules that link to it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap

import orjson

from logtriage.catalog.loader import load_catalog
from logtriage.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rule_id", metavar="ID", help="a rule id or alias (e.g. cuda.oom, E011, DDP101)")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--patterns", action="append", default=[], metavar="DIR")


def _lint_registry():
    try:
        return importlib.import_module("logtriage.lint.registry")
    except ImportError:
        return None


def run(args: argparse.Namespace) -> int:
    catalog = load_catalog(args.patterns)
    rule = catalog.get(args.rule_id)
    lint = _lint_registry()
    if rule is not None:
        data = rule.describe()
        if lint is not None:
            prevented = [r.describe()["id"] for r in lint.rules_preventing(rule.id)]
            data["prevented_by_lint"] = prevented
            data["diagnosed_with_lint"] = [r.describe()["id"] for r in lint.rules_linked(rule.id)
                                           if r.describe()["id"] not in prevented]
    elif lint is not None and lint.get_rule(args.rule_id) is not None:
        data = dict(lint.get_rule(args.rule_id).describe())
        data["kind"] = "lint"
    else:
        raise UsageError(f"no rule or alias named '{args.rule_id}' (see `triage catalog list`)")
    if args.format == "json":
        sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(_as_text(data))
    return 0


def _as_text(data: dict) -> str:
    head = f"{data['id']}: {data.get('title', '')}"
    lines = [head, "=" * min(len(head), 78)]
    facts = [(k, data.get(k)) for k in ("kind", "category", "layer", "role", "severity", "aliases")]
    lines += [f"{k:<10} {', '.join(v) if isinstance(v, list) else v}" for k, v in facts if v]
    for key in ("explanation", "fix", "misdiagnosis"):
        if data.get(key):
            lines += ["", key.upper(), textwrap.indent(textwrap.fill(str(data[key]), 76), "  ")]
    docs = data.get("docs")
    if isinstance(docs, dict):
        for key, value in docs.items():
            lines += ["", str(key).upper(), textwrap.indent(str(value).strip(), "  ")]
    for key, label in (("prevents", "PREVENTS (runtime rules)"), ("helps_diagnose", "HELPS DIAGNOSE (runtime rules)"),
                       ("prevented_by_lint", "PREVENTED BY (lint rules)"),
                       ("diagnosed_with_lint", "EASIER TO DIAGNOSE WITH (lint rules)"), ("references", "REFERENCES")):
        if data.get(key):
            lines += ["", label] + [f"  {item}" for item in data[key]]
    if data.get("path"):
        lines += ["", f"defined in {data['path']}"]
    return "\n".join(lines)
