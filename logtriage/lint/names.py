"""Name resolution for one module: import aliases and dotted names of calls.

``import torch.distributed as dist`` makes ``dist.all_reduce`` resolve to
``torch.distributed.all_reduce``; ``from torch.distributed import barrier as b`` makes ``b`` resolve
to ``torch.distributed.barrier``. Names that were not imported resolve to themselves
(``self.model``, ``writer.add_scalar``), which is what the checks compare against.
"""

from __future__ import annotations

import ast

# Where collectives live. `torch.distributed.distributed_c10d.all_reduce` counts like the short name.
DIST_MODULES = ("torch.distributed", "deepspeed.comm")

COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter",
    "scatter_object_list", "new_group", "_all_gather_base", "_reduce_scatter_base",
    "all_reduce_coalesced", "all_gather_coalesced",
})
# Collectives that also synchronise the host (so files written before them are visible after).
HOST_SYNCS = frozenset({
    "barrier", "monitored_barrier", "broadcast_object_list", "all_gather_object", "gather_object",
    "scatter_object_list",
})
# Hugging Face Accelerate: methods of an `accelerator` object that are collectives.
ACCELERATE_COLLECTIVES = frozenset({"wait_for_everyone", "gather", "gather_for_metrics", "reduce",
                                    "pad_across_processes"})
ACCELERATE_SYNCS = frozenset({"wait_for_everyone"})


def dotted(node: ast.AST) -> str | None:
    """`a.b.c` for Name/Attribute chains, else None (calls, subscripts in the chain)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


class ImportMap:
    """Local name -> fully qualified dotted name, from the module's import statements."""

    def __init__(self, nodes: "ast.AST | list[ast.AST]"):
        self.aliases: dict[str, str] = {}
        for node in nodes if isinstance(nodes, list) else ast.walk(nodes):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.aliases[alias.asname] = alias.name
                    else:
                        root = alias.name.split(".")[0]
                        self.aliases.setdefault(root, root)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    if alias.name != "*":
                        self.aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def is_import(self, name: str) -> bool:
        return name in self.aliases

    def qualify(self, node: ast.AST) -> str | None:
        name = dotted(node)
        if name is None:
            return None
        root, _, rest = name.partition(".")
        if root in self.aliases:
            base = self.aliases[root]
            return f"{base}.{rest}" if rest else base
        return name

    def mentions_module(self, prefix: str) -> bool:
        return any(v == prefix or v.startswith(prefix + ".") for v in self.aliases.values())


def collective_of(call: ast.Call, imports: ImportMap) -> str | None:
    """The collective a call runs (`all_reduce`, `barrier`, ...), or None."""
    qual = imports.qualify(call.func)
    if qual is None:
        return None
    for module in DIST_MODULES:
        if qual.startswith(module + "."):
            last = qual.rsplit(".", 1)[-1]
            return last if last in COLLECTIVES else None
    if isinstance(call.func, ast.Attribute) and call.func.attr in ACCELERATE_COLLECTIVES:
        receiver = dotted(call.func.value) or ""
        if receiver.split(".")[-1].endswith("accelerator"):
            return call.func.attr
    return None


def is_host_sync(name: str) -> bool:
    return name in HOST_SYNCS or name in ACCELERATE_SYNCS


def on_subgroup(call: ast.Call) -> bool:
    """A collective on an explicit process subgroup is meant to run only on that group's ranks."""
    for kw in call.keywords:
        if kw.arg == "group" and not (isinstance(kw.value, ast.Constant) and kw.value.value is None):
            qual = dotted(kw.value) or ""
            return not qual.endswith("WORLD")
    return False


def kwarg(call: ast.Call, name: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def has_star_kwargs(call: ast.Call) -> bool:
    return any(kw.arg is None for kw in call.keywords)


def is_const(node: ast.AST | None, value: object) -> bool:
    """`node` is the literal `value` (True/False/None compared by identity)."""
    if not isinstance(node, ast.Constant):
        return False
    if isinstance(value, bool) or value is None:
        return node.value is value
    return node.value == value and not isinstance(node.value, bool)
