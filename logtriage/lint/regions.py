"""Walk a module once and record, for every call, its function scope and the guard it sits under.

A *rank guard* is a branch that only some ranks take: the body or the else of an `if` whose test
splits ranks, the statements after `if rank != 0: return`, or the body of a `@rank_zero_only`
function. A *single-process guard* is a branch taken only when the job is not distributed
(`if world_size == 1:`, `if not args.distributed:`, the else of `if ddp:`). Checks read these
records; nothing here decides what is a finding.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from enum import Enum

from logtriage.lint.names import ImportMap, dotted
from logtriage.lint.rankexpr import RankModel, rank_only_decorator

Scope = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | None
DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)
EXIT_CALLS = frozenset({"sys.exit", "exit", "quit", "os._exit"})
DIST_FLAGS = frozenset({"ddp", "distributed", "is_distributed", "use_ddp", "use_distributed", "multi_gpu",
                        "multiprocessing_distributed", "dist_enabled", "is_initialized",
                        "is_dist_avail_and_initialized", "is_dist_initialized"})
WORLD_SIZES = frozenset({"world_size", "get_world_size", "num_processes", "n_gpu", "ngpus", "num_gpus", "nprocs",
                         "ddp_world_size"})


class GuardKind(str, Enum):
    RANK = "rank"        # only some ranks run this
    SINGLE = "single"    # only runs when there is one process


@dataclass(frozen=True, eq=False)
class Guard:
    kind: GuardKind
    node: ast.AST        # the `if` (or the decorated function)
    branch: str          # body | orelse | after | decorator
    parent: "Guard | None" = None

    @property
    def line(self) -> int:
        return getattr(self.node, "lineno", 0)

    def chain(self) -> list["Guard"]:
        out, g = [], self
        while g is not None:
            out.append(g)
            g = g.parent
        return out

    def innermost(self, kind: GuardKind) -> "Guard | None":
        return next((g for g in self.chain() if g.kind is kind), None)


def innermost(guard: Guard | None, kind: GuardKind) -> Guard | None:
    return guard.innermost(kind) if guard is not None else None


@dataclass(frozen=True, eq=False)
class CallSite:
    call: ast.Call
    scope: Scope
    guard: Guard | None
    stmt: ast.stmt


@dataclass(frozen=True, eq=False)
class RankBlock:
    """The statements of one rank-only branch and the statements that follow its `if`."""

    node: ast.If
    branch: str
    stmts: list[ast.stmt]
    following: list[ast.stmt]
    scope: Scope
    guard: Guard


@dataclass
class Regions:
    calls: list[CallSite] = field(default_factory=list)
    refs: list[tuple[str, Scope, Guard | None]] = field(default_factory=list)   # names used as values
    blocks: list[RankBlock] = field(default_factory=list)
    defs: dict[str, list[ast.AST]] = field(default_factory=dict)                # function/class name -> defs


def ends_in_exit(stmts: list[ast.stmt]) -> bool:
    if not stmts:
        return False
    last = stmts[-1]
    if isinstance(last, (ast.Return, ast.Raise, ast.Continue, ast.Break)):
        return True
    return (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call)
            and (dotted(last.value.func) or "") in EXIT_CALLS)


def single_process_branch(test: ast.AST) -> str | None:
    """Which branch of `if test:` runs only without distribution: "body", "orelse" or None."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = single_process_branch(test.operand)
        return {"body": "orelse", "orelse": "body"}.get(inner or "")
    target = test.func if isinstance(test, ast.Call) else test
    name = (dotted(target) or "").rsplit(".", 1)[-1]
    if name in DIST_FLAGS:
        return "orelse"
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left = test.left.func if isinstance(test.left, ast.Call) else test.left
        right = test.comparators[0]
        if (dotted(left) or "").rsplit(".", 1)[-1] in WORLD_SIZES and isinstance(right, ast.Constant):
            op, value = type(test.ops[0]), right.value
            if (op is ast.Eq and value == 1) or (op is ast.LtE and value == 1) or (op is ast.Lt and value == 2):
                return "body"
            if (op is ast.Gt and value == 1) or (op is ast.NotEq and value == 1) or (op is ast.GtE and value == 2):
                return "orelse"
    return None


class _Walker:
    def __init__(self, imports: ImportMap, ranks: RankModel):
        self.imports = imports
        self.ranks = ranks
        self.out = Regions()

    def block(self, stmts: list[ast.stmt], scope: Scope, guard: Guard | None) -> None:
        current = guard
        for index, stmt in enumerate(stmts):
            self.stmt(stmt, scope, current, stmts[index + 1:])
            if isinstance(stmt, ast.If) and self.ranks.splits(stmt.test):
                body_exits, else_exits = ends_in_exit(stmt.body), ends_in_exit(stmt.orelse)
                if body_exits != else_exits:
                    current = Guard(GuardKind.RANK, stmt, "after", current)

    def stmt(self, stmt: ast.stmt, scope: Scope, guard: Guard | None, following: list[ast.stmt]) -> None:
        if isinstance(stmt, (*DEFS, ast.ClassDef)):
            self.out.defs.setdefault(stmt.name, []).append(stmt)
            for deco in stmt.decorator_list:
                self.exprs(deco, scope, guard, stmt)
            inner = None
            if isinstance(stmt, DEFS) and rank_only_decorator(stmt, self.imports):
                inner = Guard(GuardKind.RANK, stmt, "decorator")
            self.block(stmt.body, stmt, inner)
            return
        if isinstance(stmt, ast.If):
            self.exprs(stmt.test, scope, guard, stmt)
            if self.ranks.splits(stmt.test):
                body_g = Guard(GuardKind.RANK, stmt, "body", guard)
                else_g = Guard(GuardKind.RANK, stmt, "orelse", guard)
                self.out.blocks.append(RankBlock(stmt, "body", stmt.body, following, scope, body_g))
                if stmt.orelse:
                    self.out.blocks.append(RankBlock(stmt, "orelse", stmt.orelse, following, scope, else_g))
            else:
                single = single_process_branch(stmt.test)
                body_g = Guard(GuardKind.SINGLE, stmt, "body", guard) if single == "body" else guard
                else_g = Guard(GuardKind.SINGLE, stmt, "orelse", guard) if single == "orelse" else guard
            self.block(stmt.body, scope, body_g)
            self.block(stmt.orelse, scope, else_g)
            return
        for name, value in ast.iter_fields(stmt):
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                self.block(value, scope, guard)
            elif isinstance(value, list) and value and isinstance(value[0], ast.excepthandler):
                for handler in value:
                    if handler.type is not None:
                        self.exprs(handler.type, scope, guard, stmt)
                    self.block(handler.body, scope, guard)
            elif isinstance(value, list) and value and isinstance(value[0], ast.match_case):
                for case in value:
                    self.block(case.body, scope, guard)
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, ast.AST):
                        self.exprs(item, scope, guard, stmt)
            elif isinstance(value, ast.AST):
                self.exprs(value, scope, guard, stmt)

    def exprs(self, node: ast.AST, scope: Scope, guard: Guard | None, stmt: ast.stmt) -> None:
        todo = [node]
        while todo:
            cur = todo.pop()
            if isinstance(cur, ast.Lambda):
                continue
            if isinstance(cur, ast.Call):
                self.out.calls.append(CallSite(cur, scope, guard, stmt))
                callee = cur.func
                todo.extend(a for a in ast.iter_child_nodes(cur) if a is not callee)
                if isinstance(callee, ast.Attribute):
                    todo.append(callee.value)
                continue
            if isinstance(cur, ast.Name) and isinstance(cur.ctx, ast.Load):
                self.out.refs.append((cur.id, scope, guard))
            todo.extend(ast.iter_child_nodes(cur))


def scan(tree: ast.Module, imports: ImportMap, ranks: RankModel) -> Regions:
    walker = _Walker(imports, ranks)
    walker.block(tree.body, None, None)
    return walker.out
