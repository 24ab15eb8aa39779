"""Step loops: where a loop synchronises ranks, which `break`/`continue` belong to it, and whether
an `if` test reads per-rank data (a loss value, a batch, a shape, the wall clock)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Iterator

from logtriage.lint.names import collective_of, dotted
from logtriage.lint.pyfile import PyFile

LOOPS = (ast.For, ast.AsyncFor, ast.While)
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
DATA_METHODS = frozenset({"item", "isnan", "isinf", "isfinite", "any", "all", "numel", "nelement", "size", "tolist"})
DATA_FUNCS = frozenset({"torch.isnan", "torch.isinf", "torch.isfinite", "torch.any", "torch.all", "math.isnan",
                        "math.isinf", "math.isfinite", "numpy.isnan", "numpy.isinf", "numpy.isfinite", "len"})
DATA_WORDS = frozenset({"loader", "dataloader", "data", "dataset", "datasets", "batch", "batches", "sample",
                        "samples", "stream", "feed", "prefetcher", "iterator", "queue", "examples", "inputs",
                        "records", "dl"})
WORD = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])")
CLOCKS = frozenset({"time.time", "time.perf_counter", "time.monotonic", "time.time_ns", "datetime.datetime.now"})


@dataclass(frozen=True)
class Skip:
    stmt: ast.Break | ast.Continue
    test: ast.expr           # the test of the innermost `if` around it
    if_node: ast.If


def walk_body(stmts: list[ast.stmt], into_loops: bool = True) -> Iterator[ast.AST]:
    """Every node under `stmts`, not entering nested functions/classes (nor loops, if asked)."""
    todo: list[ast.AST] = list(reversed(stmts))
    while todo:
        node = todo.pop()
        yield node
        for child in reversed(list(ast.iter_child_nodes(node))):
            if isinstance(child, SCOPES) or (not into_loops and isinstance(child, LOOPS)):
                continue
            todo.append(child)


def sync_points(pf: PyFile, loop: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for collectives and DDP backward passes in the loop body."""
    out = []
    body = loop.body + getattr(loop, "orelse", [])
    for node in walk_body(body):
        if not isinstance(node, ast.Call):
            continue
        site_name = _collective(pf, node)
        if site_name:
            out.append((node.lineno, f"`{site_name}`"))
        elif pf.wrapped_models and isinstance(node.func, ast.Attribute) and node.func.attr == "backward":
            out.append((node.lineno, "the DDP/FSDP gradient all-reduce in `backward()`"))
    return out


def _collective(pf: PyFile, call: ast.Call) -> str | None:
    return collective_of(call, pf.imports)


def skips(loop: ast.AST) -> Iterator[Skip]:
    """`break`/`continue` statements of this loop (not of a nested one) with their `if`."""
    def visit(stmts: list[ast.stmt], enclosing: ast.If | None) -> Iterator[Skip]:
        for stmt in stmts:
            if isinstance(stmt, (ast.Break, ast.Continue)) and enclosing is not None:
                yield Skip(stmt, enclosing.test, enclosing)
            elif isinstance(stmt, ast.If):
                yield from visit(stmt.body, stmt)
                yield from visit(stmt.orelse, stmt)
            elif isinstance(stmt, (*LOOPS, *SCOPES)):
                continue
            else:
                for field in ("body", "orelse", "finalbody"):
                    yield from visit(getattr(stmt, field, []) or [], enclosing)
                for handler in getattr(stmt, "handlers", []) or []:
                    yield from visit(handler.body, enclosing)
    yield from visit(loop.body, None)


def loop_data_names(loop: ast.AST) -> set[str]:
    """Names a `for` loop binds from per-rank data: the loop reads something named like a data
    source (loader, dataset, batches, samples, ...), and not the counter of enumerate/range."""
    if not isinstance(loop, (ast.For, ast.AsyncFor)):
        return set()
    target, it = loop.target, loop.iter
    it_name = dotted(it.func) if isinstance(it, ast.Call) else None
    if it_name == "range":
        return set()
    sources = [(dotted(n) or "").rsplit(".", 1)[-1] for n in ast.walk(it) if isinstance(n, (ast.Name, ast.Attribute))]
    if not any(w.lower() in DATA_WORDS for name in sources for w in WORD.findall(name)):
        return set()     # `for mode in Modes:`, `for name in configs:`: the same on every rank
    if it_name == "enumerate" and isinstance(target, ast.Tuple) and target.elts:
        target = ast.Tuple(elts=target.elts[1:], ctx=ast.Store())
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def data_dependence(pf: PyFile, test: ast.expr, data_names: set[str]) -> str | None:
    """Why ranks may disagree on `test`: "a tensor value", "the wall clock", ... or None."""
    for node in ast.walk(test):
        if isinstance(node, ast.Call):
            qual = pf.qual(node)
            if qual in CLOCKS:
                return "the wall clock, which differs per rank"
            if isinstance(node.func, ast.Attribute) and node.func.attr in DATA_METHODS:
                return f"a per-rank tensor value (`.{node.func.attr}()`)"
            if qual in DATA_FUNCS and qual != "len":
                return f"a per-rank tensor value (`{qual}`)"
            if qual == "len" and node.args and _reads(node.args[0], data_names):
                return "the length of this rank's batch"
        elif isinstance(node, ast.Attribute) and node.attr == "shape":
            return "a per-rank tensor shape"
        elif isinstance(node, ast.Name) and node.id in data_names:
            return f"this rank's batch (`{node.id}`)"
    return None


def _reads(node: ast.AST, names: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node))


def reduced_names(pf: PyFile, loop: ast.AST) -> set[str]:
    """Names passed to a collective in the loop: after it, every rank holds the same value."""
    out = set()
    for node in walk_body(loop.body):
        if isinstance(node, ast.Call) and _collective(pf, node) and node.args:
            out |= {n.id for n in ast.walk(node.args[0]) if isinstance(n, ast.Name)}
    return out
