"""One-step value tracing inside a function: where a name used as a path came from."""

from __future__ import annotations

import ast
from typing import Iterator

from logtriage.lint.names import dotted
from logtriage.lint.pyfile import PyFile
from logtriage.lint.regions import Scope

URL_PREFIXES = ("http://", "https://", "s3://", "gs://", "hf://")
DOWNLOADERS = frozenset({"hf_hub_download", "snapshot_download", "download_url_to_file", "urlretrieve",
                         "cached_path", "download_url", "get_file", "download"})
CLI_PARSERS = frozenset({"parse_args", "parse_known_args", "parse_args_into_dataclasses"})


def assignments(pf: PyFile, scope: Scope, name: str) -> Iterator[ast.expr]:
    """Right-hand sides assigned to `name` in `scope` (or at module level for module code)."""
    body = scope.body if scope is not None else pf.tree.body
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not scope:
                continue
            if isinstance(node, ast.Assign) and any(dotted(t) == name for t in node.targets):
                yield node.value
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and dotted(node.target) == name and node.value:
                yield node.value


def expands(pf: PyFile, expr: ast.expr, scope: Scope) -> list[ast.expr]:
    """`expr` plus what each plain name in it was assigned in the same scope (one step)."""
    out = [expr]
    for node in ast.walk(expr):
        if isinstance(node, ast.Name):
            out.extend(assignments(pf, scope, node.id))
    return out


def cli_namespaces(pf: PyFile) -> frozenset[str]:
    """Names bound to `parser.parse_args()` results (their attributes are command-line values)."""
    names = set()
    for node in pf.nodes:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Attribute) and func.attr in CLI_PARSERS:
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        names.add(target.id)
                    elif isinstance(target, ast.Tuple):
                        names.update(e.id for e in target.elts if isinstance(e, ast.Name))
    return frozenset(names)


def untrusted_origin(pf: PyFile, expr: ast.expr, scope: Scope) -> str | None:
    """Where a path comes from when its content is not the program's own: a URL, a download, a
    command-line argument, an environment variable, user input. None when unknown or local."""
    cli = cli_namespaces(pf)
    for candidate in expands(pf, expr, scope):
        for node in ast.walk(candidate):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(URL_PREFIXES):
                return "a URL"
            if isinstance(node, ast.Call):
                qual = pf.qual(node)
                last = qual.rsplit(".", 1)[-1]
                if last in DOWNLOADERS:
                    return f"a download (`{last}`)"
                if qual in ("input", "builtins.input"):
                    return "user input"
                if qual in ("os.getenv", "os.environ.get"):
                    return "an environment variable"
            if isinstance(node, ast.Subscript) and (dotted(node.value) or "") in ("os.environ", "sys.argv"):
                return "an environment variable" if dotted(node.value) == "os.environ" else "a command-line argument"
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in cli:
                return f"a command-line argument (`{node.value.id}.{node.attr}`)"
    return None


def same_path(a: ast.expr, b: ast.expr) -> bool:
    return ast.dump(a) == ast.dump(b)
