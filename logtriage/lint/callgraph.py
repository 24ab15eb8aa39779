"""Cheap, same-file call resolution: which local function a call runs, which functions every rank
reaches, and what a local helper does on every rank that calls it.

Resolution is by name and deliberately simple: `foo()` is the module's `foo`, `self.foo()` is a
method `foo` of a class in the file, `obj.foo()` is such a method when `obj` is not an imported
module and `foo` is not a name every library uses (`step`, `backward`, `item` ...). Anything else
is unknown, and unknown never produces a finding.
"""

from __future__ import annotations

import ast
from typing import Callable

from logtriage.lint.names import ImportMap, dotted
from logtriage.lint.regions import DEFS, CallSite, GuardKind, Regions, Scope, innermost

COMMON_METHODS = frozenset({
    "step", "backward", "item", "zero_grad", "to", "cuda", "cpu", "append", "extend", "update", "get",
    "items", "keys", "values", "format", "join", "split", "strip", "read", "write", "close", "forward",
    "state_dict", "load_state_dict", "parameters", "eval", "train", "save", "load", "add_scalar", "log",
    "info", "warning", "error", "debug", "print", "copy", "clone", "detach", "mean", "sum", "numpy",
    "float", "half", "run", "start", "wait", "flush", "set_epoch", "apply", "reset", "build", "init",
})
MAX_DEPTH = 4


class CallGraph:
    def __init__(self, regions: Regions, imports: ImportMap):
        self.regions = regions
        self.imports = imports
        self.methods: dict[str, list[ast.AST]] = {}
        self.functions: dict[str, list[ast.AST]] = {}
        self.classes: dict[str, ast.ClassDef] = {}
        for name, defs in regions.defs.items():
            for d in defs:
                if isinstance(d, ast.ClassDef):
                    self.classes[name] = d
                    for item in d.body:
                        if isinstance(item, DEFS):
                            self.methods.setdefault(item.name, []).append(item)
        method_ids = {id(m) for ms in self.methods.values() for m in ms}
        for name, defs in regions.defs.items():
            fns = [d for d in defs if isinstance(d, DEFS) and id(d) not in method_ids]
            if fns:
                self.functions[name] = fns
        self.by_scope: dict[int, list[CallSite]] = {}
        for site in regions.calls:
            self.by_scope.setdefault(id(site.scope), []).append(site)
        self._reached: set[int] | None = None

    # -- resolution -------------------------------------------------------------------------
    def resolve(self, call: ast.Call) -> list[ast.AST]:
        func = call.func
        if isinstance(func, ast.Name):
            if func.id in self.functions:
                return list(self.functions[func.id])
            if func.id in self.classes:
                cls = self.classes[func.id]
                return [m for m in cls.body if isinstance(m, DEFS) and m.name in ("__init__", "__post_init__")]
            return []
        if isinstance(func, ast.Attribute):
            receiver = dotted(func.value)
            if receiver in ("self", "cls"):
                return list(self.methods.get(func.attr, []))
            root = (receiver or "").split(".")[0]
            if root and not self.imports.is_import(root) and func.attr not in COMMON_METHODS:
                return list(self.methods.get(func.attr, []))
        return []

    def calls_in(self, scope: Scope) -> list[CallSite]:
        return self.by_scope.get(id(scope), [])

    # -- reachability -----------------------------------------------------------------------
    def reached_by_all(self, scope: Scope) -> bool:
        """Every rank runs `scope`: module code, or a function some rank-unguarded code calls."""
        if scope is None:
            return True
        if self._reached is None:
            self._reached = self._compute_reached()
        return id(scope) in self._reached

    def _compute_reached(self) -> set[int]:
        reached: set[int] = set()
        todo: list[Scope] = [None]
        seen: set[int] = {id(None)}
        while todo:
            scope = todo.pop()
            targets: list[ast.AST] = []
            for site in self.calls_in(scope):
                if site.guard is None or innermost(site.guard, GuardKind.RANK) is None:
                    targets += self.resolve(site.call)
            for name, ref_scope, guard in self.regions.refs:
                if ref_scope is scope and innermost(guard, GuardKind.RANK) is None:
                    targets += self.functions.get(name, [])
            for target in targets:
                if id(target) not in seen:
                    seen.add(id(target))
                    reached.add(id(target))
                    todo.append(target)
        return reached

    # -- summaries --------------------------------------------------------------------------
    def first_unguarded(self, scope: Scope, pick: Callable[[CallSite], str | None],
                        depth: int = 0, seen: frozenset[int] = frozenset()) -> tuple[str, int, list[str]] | None:
        """The first call (by line) that `pick` names, run by every rank that enters `scope`,
        directly or through local helpers: (what, line, [helper names on the way])."""
        if depth > MAX_DEPTH or id(scope) in seen:
            return None
        seen = seen | {id(scope)}
        best: tuple[str, int, list[str]] | None = None
        for site in sorted(self.calls_in(scope), key=lambda s: s.call.lineno):
            if innermost(site.guard, GuardKind.RANK) is not None:
                continue
            what = pick(site)
            if what:
                return (what, site.call.lineno, [])
            for target in self.resolve(site.call):
                inner = self.first_unguarded(target, pick, depth + 1, seen)
                if inner and best is None:
                    best = (inner[0], inner[1], [getattr(target, "name", "?"), *inner[2]])
            if best:
                return best
        return best
