"""Hand-made per-rank shards (`data[rank::world_size]`, `np.array_split(x, n)[rank]`) and the loops
that iterate them."""

from __future__ import annotations

import ast
from typing import Iterator

from logtriage.lint.loops import skips, sync_points
from logtriage.lint.names import dotted
from logtriage.lint.pyfile import PyFile

CHUNKERS = frozenset({"array_split", "chunk", "tensor_split"})


def _is_shard(pf: PyFile, node: ast.AST) -> bool:
    ranks = pf.ranks
    if isinstance(node, ast.Subscript):
        sl = node.slice
        if isinstance(sl, ast.Slice):
            return (sl.lower is not None and ranks.contains_rank_value(sl.lower) and sl.step is not None
                    and sl.upper is None)
        if isinstance(node.value, ast.Call) and ranks.contains_rank_value(sl):
            return pf.qual(node.value).rsplit(".", 1)[-1] in CHUNKERS
    if isinstance(node, ast.Call) and pf.qual(node).endswith("islice") and len(node.args) >= 4:
        return ranks.contains_rank_value(node.args[1])
    return False


def _scope_of(pf: PyFile, node: ast.AST) -> ast.AST:
    """The innermost function holding `node` (the module when none)."""
    cur = pf.parents.get(id(node))
    while cur is not None and not isinstance(cur, (ast.FunctionDef, ast.AsyncFunctionDef)):
        cur = pf.parents.get(id(cur))
    return cur if cur is not None else pf.tree


def _evened(scope: ast.AST, base: str | None) -> bool:
    """`data = data[: len(data) // world_size * world_size]` in the same function: equal shards."""
    if base is None:
        return False
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Subscript):
            sl = node.value.slice
            if (dotted(node.value.value) == base and isinstance(sl, ast.Slice) and sl.upper is not None
                    and any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.FloorDiv) for n in ast.walk(sl.upper))):
                return True
    return False


def _base(shard: ast.AST) -> str | None:
    if isinstance(shard, ast.Subscript):
        value = shard.value
        if isinstance(value, ast.Call) and value.args:
            return dotted(value.args[0])
        return dotted(value)
    if isinstance(shard, ast.Call) and shard.args:
        return dotted(shard.args[0])
    return None


def _derived(scope: ast.AST, seeds: set[int]) -> set[str]:
    """Names bound (directly or through calls like DataLoader(...)) to an expression holding a shard."""
    names: set[str] = set()
    for _ in range(3):
        for node in ast.walk(scope):
            if not isinstance(node, ast.Assign):
                continue
            inside = {id(n) for n in ast.walk(node.value)}
            uses = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
            if inside & seeds or uses & names:
                names.update(n for n in (dotted(t) for t in node.targets) if n)
                for t in node.targets:
                    names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def _inside_join(pf: PyFile, loop: ast.AST) -> bool:
    node = pf.parents.get(id(loop))
    while node is not None:
        if isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                expr = item.context_expr
                if isinstance(expr, ast.Call) and (dotted(expr.func) or "").rsplit(".", 1)[-1] in ("join", "Join"):
                    return True
        node = pf.parents.get(id(node))
    return False


def shard_loops(pf: PyFile) -> Iterator[tuple[ast.AST, ast.AST, str]]:
    """(shard expression, loop, what the loop synchronises) for each uneven-shard hazard."""
    for shard in [n for n in pf.nodes if _is_shard(pf, n)]:
        scope = _scope_of(pf, shard)
        if _evened(scope, _base(shard)):
            continue
        names = _derived(scope, {id(shard)})
        for loop in ast.walk(scope):
            if not isinstance(loop, (ast.For, ast.AsyncFor)):
                continue
            iterated = {n.id for n in ast.walk(loop.iter) if isinstance(n, ast.Name)}
            direct = any(n is shard for n in ast.walk(loop.iter))
            if not (direct or iterated & names) or _inside_join(pf, loop):
                continue
            syncs = sync_points(pf, loop)
            if syncs:
                yield shard, loop, syncs[0][1]
                break
    yield from _round_robin_skips(pf)


def _round_robin_skips(pf: PyFile) -> Iterator[tuple[ast.AST, ast.AST, str]]:
    """`for i, x in enumerate(items): if i % world_size != rank: continue` and then a collective:
    the same hazard as a strided shard, written as a skip."""
    for loop in pf.nodes:
        if not isinstance(loop, (ast.For, ast.AsyncFor)) or _inside_join(pf, loop):
            continue
        for skip in skips(loop):
            test = skip.test.operand if isinstance(skip.test, ast.UnaryOp) else skip.test
            if not (isinstance(skip.stmt, ast.Continue) and pf.ranks.is_sharding(test)):
                continue
            later = [s for s in sync_points(pf, loop) if s[0] > (skip.if_node.end_lineno or 0)]
            if later:
                yield skip.test, loop, later[0][1]
                break
