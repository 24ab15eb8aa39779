"""Everything the Python checks read about one file, computed once: the AST, import aliases,
rank helpers, guarded regions, the local call graph, and a few whole-file facts."""

from __future__ import annotations

import ast
import re
from functools import cached_property

from logtriage.lint.callgraph import CallGraph
from logtriage.lint.names import ImportMap, collective_of, dotted, is_const, kwarg
from logtriage.lint.rankexpr import RankModel
from logtriage.lint.regions import CallSite, Regions, scan

DIST_IMPORTS = ("torch.distributed", "deepspeed", "accelerate", "horovod", "torch.nn.parallel.DistributedDataParallel",
                "torch.nn.parallel.distributed")
DIST_TEXT = re.compile(r"init_process_group|['\"]LOCAL_RANK['\"]|DistributedDataParallel|init_distributed")
CUDA_TEXT = re.compile(r"\bcuda\b|\bnccl\b", re.I)
WRAPPER_TEXT = re.compile(r"ddp|fsdp|fully_shard|DistributedDataParallel|FullyShardedDataParallel", re.I)
WRAPPERS = {"DistributedDataParallel": "DDP", "FullyShardedDataParallel": "FSDP", "fully_shard": "FSDP"}


class PyFile:
    def __init__(self, path: str, text: str, tree: ast.Module):
        self.path = path
        self.text = text
        self.lines = text.splitlines()
        self.tree = tree
        self.nodes: list[ast.AST] = list(ast.walk(tree))     # walked once; checks iterate this
        self.imports = ImportMap(self.nodes)

    # -- analyses, built on first use (most files need none of them) -------------------------
    @cached_property
    def ranks(self) -> RankModel:
        return RankModel(self.nodes, self.imports)

    @cached_property
    def regions(self) -> Regions:
        return scan(self.tree, self.imports, self.ranks)

    @cached_property
    def graph(self) -> CallGraph:
        return CallGraph(self.regions, self.imports)

    # -- whole-file facts -------------------------------------------------------------------
    @cached_property
    def is_distributed(self) -> bool:
        if any(self.imports.mentions_module(m) for m in DIST_IMPORTS):
            return True
        return bool(DIST_TEXT.search(self.text))

    @cached_property
    def runs_ranks(self) -> bool:
        """The file itself runs as several ranks: it starts a process group, wraps a model for
        DDP/FSDP, or reads a rank. (A utility that merely imports torch.distributed does not.)"""
        if re.search(r"init_process_group|init_distributed|\.prepare\(", self.text) or self.wrapped_models:
            return True
        return any(self.ranks.is_rank_value(n) for n in self.nodes if isinstance(n, (ast.Call, ast.Name, ast.Subscript)))

    @cached_property
    def uses_gpus(self) -> bool:
        return self.is_distributed and bool(CUDA_TEXT.search(self.text))

    @cached_property
    def wrapped_models(self) -> dict[str, str]:
        """Names bound to a DDP/FSDP-wrapped module -> "DDP" | "FSDP" (DDP with
        broadcast_buffers=False is left out: its forward runs no collective)."""
        out: dict[str, str] = {}
        if not WRAPPER_TEXT.search(self.text):
            return out
        for node in self.nodes:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                kind = self.wrapper_kind(node.value)
                if kind == "DDP" and is_const(kwarg(node.value, "broadcast_buffers"), False):
                    continue
                if kind:
                    for target in node.targets:
                        name = dotted(target)
                        if name:
                            out[name] = kind
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and node.value.args:
                if self.wrapper_kind(node.value) == "FSDP":
                    name = dotted(node.value.args[0])
                    if name:
                        out[name] = "FSDP"
        return out

    @cached_property
    def parents(self) -> dict[int, ast.AST]:
        """id(node) -> its parent node."""
        return {id(child): node for node in self.nodes for child in ast.iter_child_nodes(node)}

    @cached_property
    def summary_writers(self) -> frozenset[str]:
        """Names bound to a TensorBoard SummaryWriter (`writer.add_scalar` is then logging I/O)."""
        names: set[str] = set()
        if "SummaryWriter" not in self.text:
            return frozenset()
        for node in self.nodes:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                if self.qual(node.value).endswith("SummaryWriter"):
                    names.update(n for n in (dotted(t) for t in node.targets) if n)
        return frozenset(names)

    def wrapper_kind(self, call: ast.Call) -> str | None:
        """DDP/FSDP for the wrapper classes, and for helpers named after them that take the model
        first (`ddp_wrap(model, ctx)`, `smart_DDP(model)`)."""
        last = (self.imports.qualify(call.func) or "").rsplit(".", 1)[-1]
        if last in WRAPPERS:
            return WRAPPERS[last]
        if call.args and isinstance(call.args[0], (ast.Name, ast.Attribute)):
            lowered = last.lower()
            if "fsdp" in lowered:
                return "FSDP"
            if "ddp" in lowered and not lowered.startswith(("is_", "setup", "init")) and "setup" not in lowered:
                return "DDP"
        return None

    # -- per-call facts ---------------------------------------------------------------------
    def collective(self, site: CallSite) -> str | None:
        return collective_of(site.call, self.imports)

    def wrapped_forward(self, site: CallSite) -> str | None:
        """`model(x)` where `model` is DDP/FSDP-wrapped -> "DDP model" / "FSDP model"."""
        name = dotted(site.call.func)
        kind = self.wrapped_models.get(name or "")
        return f"{kind}-wrapped `{name}`" if kind else None

    def qual(self, call: ast.Call) -> str:
        return self.imports.qualify(call.func) or ""

    def col(self, node: ast.AST) -> int:
        """1-based column in characters (the AST gives a 0-based UTF-8 byte offset)."""
        line_no, offset = getattr(node, "lineno", 1), getattr(node, "col_offset", 0)
        if 0 < line_no <= len(self.lines):
            return len(self.lines[line_no - 1].encode("utf-8")[:offset].decode("utf-8", "replace")) + 1
        return offset + 1

    def source_of(self, node: ast.AST, limit: int = 60) -> str:
        text = ast.get_source_segment(self.text, node) or ast.unparse(node)
        text = " ".join(text.split())
        return text if len(text) <= limit else text[: limit - 3] + "..."
