"""Which expressions read a rank, and which `if` tests send different ranks different ways.

A rank value is a name or attribute that holds a rank (`rank`, `args.local_rank`, `ddp_rank`,
`master_process`, `accelerator.is_main_process`), a call that returns one (`dist.get_rank()`,
`is_main_process()`), an environment lookup of `RANK`/`LOCAL_RANK`, or a helper variable the module
assigned from one of those (`is_main = rank == 0`).

A test splits ranks when it compares a rank value with something other than the "not distributed"
sentinels (-1, None): `rank == 0`, `args.local_rank in [-1, 0]`, `not is_main`. A test like
`args.local_rank != -1` is the same on every rank and does not split them.
"""

from __future__ import annotations

import ast
import re

from logtriage.lint.names import ImportMap, dotted

RANKISH = re.compile(
    r"""^(?:
        (?:[a-z0-9]+_)*rank(?:_?0|_zero)?                       # rank, local_rank, ddp_rank, rank0
      | is_(?:local_|global_)?(?:main|master|primary|chief)(?:_process|_rank|_worker|_node)?
      | (?:local_)?(?:main|master)_process
      | is_(?:local_|world_|global_)?(?:process_)?zero | is_global_zero | is_rank_?(?:0|zero)
      | (?:local_)?process_index
    )$""",
    re.X | re.I,
)
RANK_GETTERS = frozenset({"get_rank", "get_local_rank", "get_global_rank", "get_node_local_rank"})
RANK_ENV = re.compile(r"^(?:LOCAL_|GROUP_|NODE_|SLURM_)?(?:PROC)?RANK$|^SLURM_PROCID$|^SLURM_LOCALID$|^OMPI_COMM_WORLD_(?:LOCAL_)?RANK$")
# Decorators that make a whole function run on one rank only.
RANK_ONLY_DECORATOR = re.compile(
    r"^(?:rank_?zero_only|rank_?0_only|master_only|main_process_only|on_(?:local_)?main_process|on_rank_?0)$")
NEUTRAL_CALLS = frozenset({"isinstance", "hasattr", "callable", "type"})


# `lora_rank`, `matrix_rank`, `max_rank` are ranks of matrices or adapters, not process ranks.
NOT_PROCESS_RANK = re.compile(r"^(?:lora|low|matrix|tensor|svd|max|min|target|adapter|num|n|approx|sparse|head)_",
                              re.I)


def is_rankish_name(name: str) -> bool:
    return bool(RANKISH.match(name)) and not NOT_PROCESS_RANK.match(name)


def _env_key(node: ast.AST) -> str | None:
    """`os.environ["RANK"]`, `os.environ.get("RANK")`, `os.getenv("RANK")` -> "RANK"."""
    if isinstance(node, ast.Subscript) and (dotted(node.value) or "").endswith("environ"):
        key = node.slice
        return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None
    if isinstance(node, ast.Call) and node.args:
        name = dotted(node.func) or ""
        if name.endswith("environ.get") or name.endswith("getenv"):
            key = node.args[0]
            return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None
    return None


class RankModel:
    """Rank knowledge about one module: helper variables, and the two predicates."""

    def __init__(self, nodes: "ast.AST | list[ast.AST]", imports: ImportMap):
        self.imports = imports
        self.helpers: set[str] = set()
        assigns = [n for n in (nodes if isinstance(nodes, list) else ast.walk(nodes))
                   if isinstance(n, (ast.Assign, ast.AnnAssign))]
        # Two passes pick up helpers defined from helpers (`is_main = rank == 0; save = is_main`).
        for _ in range(2):
            for node in assigns:
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    if self.is_rank_value(node.value) or self._compare_splits(node.value):
                        for target in targets:
                            name = dotted(target)
                            if name:
                                self.helpers.add(name)

    # -- rank values -------------------------------------------------------------------------
    def is_rank_value(self, node: ast.AST) -> bool:
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = dotted(node)
            if name is not None and name in self.helpers:
                return True
            last = node.id if isinstance(node, ast.Name) else node.attr
            return is_rankish_name(last)
        if isinstance(node, ast.Call):
            qual = self.imports.qualify(node.func) or ""
            last = qual.rsplit(".", 1)[-1]
            if last in RANK_GETTERS or (last and is_rankish_name(last)):
                return True
            if last in ("int", "str") and node.args:
                return self.is_rank_value(node.args[0])
            key = _env_key(node)
            return key is not None and bool(RANK_ENV.match(key))
        if isinstance(node, ast.Subscript):
            key = _env_key(node)
            return key is not None and bool(RANK_ENV.match(key))
        return False

    def contains_rank_value(self, node: ast.AST) -> bool:
        return any(self.is_rank_value(n) for n in ast.walk(node))

    # -- tests -------------------------------------------------------------------------------
    def splits(self, test: ast.AST) -> bool:
        """True when ranks can evaluate `test` differently (some take the branch, some don't)."""
        if isinstance(test, ast.BoolOp):
            return any(self.splits(v) for v in test.values)
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return self.splits(test.operand)
        if isinstance(test, ast.Compare):
            return self._compare_splits(test)
        if isinstance(test, ast.Call):
            qual = self.imports.qualify(test.func) or ""
            if qual.rsplit(".", 1)[-1] in NEUTRAL_CALLS:
                return False
            return self.is_rank_value(test) or any(self.contains_rank_value(a) for a in test.args)
        if isinstance(test, (ast.Name, ast.Attribute, ast.Subscript)):
            return self.is_rank_value(test)
        return False

    def _compare_splits(self, node: ast.AST) -> bool:
        if not isinstance(node, ast.Compare):
            return False
        operands = [node.left, *node.comparators]
        ranked = [o for o in operands if self.contains_rank_value(o)]
        if not ranked:
            return False
        others = [o for o in operands if not self.contains_rank_value(o)]
        if others and all(_is_sentinel(o) for o in others):
            return False
        if self.is_sharding(node):
            return False    # `i % world_size == rank`: every rank takes it, for its own items
        return True

    def is_sharding(self, node: ast.AST) -> bool:
        """`i % world_size != rank`: round-robin work sharding, not a rank-only branch."""
        if not isinstance(node, ast.Compare):
            return False
        operands = [node.left, *node.comparators]
        mods = [o for o in operands if isinstance(o, ast.BinOp) and isinstance(o.op, ast.Mod)
                and not self.contains_rank_value(o.left)]
        return bool(mods) and any(self.contains_rank_value(o) for o in operands if o not in mods)


def _is_sentinel(node: ast.AST) -> bool:
    """-1 and None mean "not launched distributed" and are the same on every rank."""
    if isinstance(node, ast.Constant) and node.value is None:
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        return node.operand.value == 1
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_sentinel(e) for e in node.elts)
    return False


def rank_only_decorator(func: ast.AST, imports: ImportMap) -> bool:
    for deco in getattr(func, "decorator_list", []):
        target = deco.func if isinstance(deco, ast.Call) else deco
        qual = imports.qualify(target) or ""
        if RANK_ONLY_DECORATOR.match(qual.rsplit(".", 1)[-1]):
            return True
    return False


def zero_side(test: ast.AST, ranks: RankModel) -> bool | None:
    """True when `test` holding means "the main rank" (`rank == 0`, `is_main`), False when it means
    "the other ranks" (`rank != 0`, `local_rank not in [-1, 0]`), None when it is neither."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = zero_side(test.operand, ranks)
        return None if inner is None else not inner
    if isinstance(test, (ast.Name, ast.Attribute, ast.Call)) and ranks.is_rank_value(test):
        name = (dotted(test.func if isinstance(test, ast.Call) else test) or "").rsplit(".", 1)[-1]
        return not name.lower().endswith(("rank", "index"))   # `if rank:` means rank != 0
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        op, right = test.ops[0], test.comparators[0]
        zeroish = (isinstance(right, ast.Constant) and right.value == 0) or (
            isinstance(right, (ast.List, ast.Tuple, ast.Set))
            and any(isinstance(e, ast.Constant) and e.value == 0 for e in right.elts))
        if zeroish and isinstance(op, (ast.Eq, ast.In, ast.LtE, ast.Is)):
            return True
        if zeroish and isinstance(op, (ast.NotEq, ast.NotIn, ast.Gt, ast.IsNot)):
            return False
    return None
