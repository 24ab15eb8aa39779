"""Rules about step loops and data that make ranks disagree: DDP104-DDP107."""

from __future__ import annotations

import ast
import re
from typing import Iterator

from logtriage.lint.loops import (LOOPS, data_dependence, loop_data_names, reduced_names, skips, sync_points,
                                  walk_body)
from logtriage.lint.model import FileKind, Hit, LintRule, RuleDocs, Severity
from logtriage.lint.names import dotted, is_const, kwarg
from logtriage.lint.pyfile import PyFile
from logtriage.lint.rules_collective import HANG_IDS
from logtriage.lint.shards import shard_loops


def check_data_dependent_skip(pf: PyFile) -> Iterator[Hit]:
    if not pf.is_distributed:
        return
    for loop in pf.nodes:
        if not isinstance(loop, LOOPS):
            continue
        syncs = sync_points(pf, loop)
        if not syncs:
            continue
        data, reduced = loop_data_names(loop), reduced_names(pf, loop)
        for skip in skips(loop):
            if pf.ranks.splits(skip.test):
                continue    # a rank test: DDP101 reports the collectives it skips
            if {n.id for n in ast.walk(skip.test) if isinstance(n, ast.Name)} & reduced:
                continue    # the value went through a collective: every rank agrees on it
            why = data_dependence(pf, skip.test, data)
            if why is None:
                continue
            keyword = "continue" if isinstance(skip.stmt, ast.Continue) else "break"
            later = [s for s in syncs if s[0] > (skip.if_node.end_lineno or 0)] if keyword == "continue" else syncs
            if not later:
                continue
            line, what = later[0]
            yield Hit(skip.stmt.lineno, pf.col(skip.stmt),
                      f"`{keyword}` under `if {pf.source_of(skip.test)}` depends on {why}; a rank that takes it "
                      f"skips {what} (line {line}) that the other ranks run, so they wait in a collective this "
                      f"rank never enters")


def check_uneven_shards(pf: PyFile) -> Iterator[Hit]:
    if not pf.is_distributed:
        return
    for shard, loop, what in shard_loops(pf):
        yield Hit(shard.lineno, pf.col(shard),
                  f"`{pf.source_of(shard)}` gives ranks shards whose lengths differ when the data does not "
                  f"divide evenly; the loop at line {loop.lineno} runs {what} once per item, so the ranks "
                  f"with more items wait in a collective the others never enter")


def _samplers(pf: PyFile) -> dict[str, ast.Call]:
    """Names bound to a shuffling DistributedSampler(...) call."""
    out = {}
    for node in pf.nodes:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _is_shuffling_sampler(pf, node.value):
            for target in node.targets:
                name = dotted(target)
                if name:
                    out[name] = node.value
    return out


def _is_shuffling_sampler(pf: PyFile, call: ast.AST) -> bool:
    return (isinstance(call, ast.Call) and pf.qual(call).endswith("DistributedSampler")
            and not is_const(kwarg(call, "shuffle"), False))


def _bound_names(pf: PyFile, call: ast.Call) -> set[str]:
    """Names an assignment binds `call` to (`sampler = DistributedSampler(ds)` -> {"sampler"})."""
    parent = pf.parents.get(id(call))
    if isinstance(parent, ast.Assign) and parent.value is call:
        return {n for n in (dotted(t) for t in parent.targets) if n}
    return set()


def _loaders_over(pf: PyFile, sampler: ast.Call) -> set[str]:
    names = _bound_names(pf, sampler)
    loaders: set[str] = set()
    for node in pf.nodes:
        if isinstance(node, ast.Call) and pf.qual(node).endswith("DataLoader"):
            given = kwarg(node, "sampler")
            if given is sampler or (given is not None and (dotted(given) or "") in names):
                loaders |= _bound_names(pf, node)
    return loaders


def _epoch_loop_over(pf: PyFile, loaders: set[str]) -> bool:
    """A loop that contains a loop over one of `loaders` (an epoch loop around the data loop)."""
    for outer in pf.nodes:
        if isinstance(outer, LOOPS):
            for inner in walk_body(outer.body):
                if isinstance(inner, (ast.For, ast.AsyncFor)):
                    used = {dotted(n) for n in ast.walk(inner.iter) if isinstance(n, (ast.Name, ast.Attribute))}
                    if used & loaders:
                        return True
    return False


def check_sampler_without_set_epoch(pf: PyFile) -> Iterator[Hit]:
    if "DistributedSampler" not in pf.text:
        return
    calls = [n for n in pf.nodes if isinstance(n, ast.Call)]
    if any(isinstance(c.func, ast.Attribute) and c.func.attr == "set_epoch" for c in calls):
        return
    for call in calls:
        if not (_is_shuffling_sampler(pf, call) and kwarg(call, "seed") is None):
            continue
        if _epoch_loop_over(pf, _loaders_over(pf, call)):
            yield Hit(call.lineno, pf.col(call),
                      "DistributedSampler shuffles and an epoch loop iterates its loader, but nothing in this "
                      "file calls `set_epoch(epoch)`; every epoch visits the data in the same order")


EVAL_NAME = re.compile(r"val|test|eval", re.I)


def _evaluation_loader(pf: PyFile, call: ast.Call) -> bool:
    """Named like an evaluation loader (`val_loader = DataLoader(dataset_val, ...)`): BatchNorm
    runs in eval mode there, where a batch of one is fine."""
    names = _bound_names(pf, call) | {dotted(a) or "" for a in call.args[:1]}
    return any(EVAL_NAME.search(n) for n in names)


BATCHNORM = re.compile(r"\b(?:BatchNorm[123]d|SyncBatchNorm|convert_sync_batchnorm)\b")


def check_loader_without_drop_last(pf: PyFile) -> Iterator[Hit]:
    if "DistributedSampler" not in pf.text or not BATCHNORM.search(pf.text):
        return      # without BatchNorm a short last batch breaks nothing this rule knows of
    samplers = _samplers(pf)
    for call in pf.nodes:
        if not (isinstance(call, ast.Call) and pf.qual(call).endswith("DataLoader")):
            continue
        sampler = kwarg(call, "sampler")
        if sampler is None or not (_is_shuffling_sampler(pf, sampler) or (dotted(sampler) or "") in samplers):
            continue
        if is_const(kwarg(call, "drop_last"), True) or is_const(kwarg(call, "batch_size"), 1):
            continue
        if any(kw.arg is None for kw in call.keywords) or _evaluation_loader(pf, call):
            continue
        yield Hit(call.lineno, pf.col(call),
                  "training DataLoader over a DistributedSampler keeps the short last batch "
                  "(drop_last=False) in a file that uses BatchNorm: a final batch of one sample makes "
                  "BatchNorm raise on every rank; pass drop_last=True")


RULES = (
    LintRule(
        id="DDP104", name="data-dependent-skip-in-step-loop", severity=Severity.WARNING, kind=FileKind.PYTHON,
        title="`break`/`continue` on per-rank data in a loop that runs collectives",
        prevents=HANG_IDS, fixture="DDP104_data_dependent_skip.py", check=check_data_dependent_skip,
        references=("seed:ddp-rules (rule 2)", "seed:colossalai-ch11 (hang every N steps)"),
        docs=RuleDocs(
            what="Inside a loop that runs a collective or a DDP/FSDP backward, a `continue` or `break` under a "
                 "test that reads this rank's data: a loss value (`.item()`, `torch.isnan`), the batch "
                 "(`if batch is None`), a shape, or the wall clock. Step counters (`if step >= max_steps`) and "
                 "values that went through a collective first are exempt.",
            why="Each rank sees different data, so one rank skips the backward (or leaves the loop) while the "
                "others enter the gradient all-reduce. The counts of collectives diverge: the others wait for "
                "the timeout, or pair collectives from different steps.",
            example="for batch in loader:\n    loss = model(batch)\n    if torch.isnan(loss):\n"
                    "        continue            # only this rank skips the all-reduce below\n    loss.backward()\n",
            fix="Agree before skipping: all-reduce a flag and skip on every rank together\n"
                "bad = torch.tensor(float(torch.isnan(loss)))\ndist.all_reduce(bad)\nif bad.item() > 0:\n"
                "    continue\nor zero the loss instead of skipping; for time budgets, decide on rank 0 and broadcast.",
        ),
    ),
    LintRule(
        id="DDP105", name="uneven-rank-shards", severity=Severity.WARNING, kind=FileKind.PYTHON,
        title="Hand-made per-rank data shards with unequal lengths feed a loop with collectives",
        prevents=HANG_IDS, fixture="DDP105_uneven_rank_shards.py", check=check_uneven_shards,
        references=("https://pytorch.org/tutorials/advanced/generic_join.html",),
        docs=RuleDocs(
            what="Data sharded by hand per rank (`data[rank::world_size]`, `np.array_split(x, n)[rank]`, "
                 "`torch.chunk(x, n)[rank]`, `islice(it, rank, None, n)`) and iterated by a loop that runs a "
                 "collective or a DDP backward, outside a `join()` context.",
            why="When the length does not divide by the world size, some ranks get one item more. They run "
                "one more step, and its collective waits for ranks that already left the loop (uneven "
                "inputs): a timeout at the end of the epoch.",
            example="shard = samples[rank::world_size]\nfor x in shard:\n    dist.all_reduce(model_step(x))\n",
            fix="Use a DistributedSampler (it pads to equal lengths), truncate to a multiple of the world "
                "size before sharding, or wrap the loop in `with model.join():` (DDP) / `Join([...])`.",
        ),
    ),
    LintRule(
        id="DDP106", name="sampler-without-set-epoch", severity=Severity.WARNING, kind=FileKind.PYTHON,
        title="Shuffling DistributedSampler and no `set_epoch` call",
        prevents=(), fixture="DDP106_sampler_without_set_epoch.py", check=check_sampler_without_set_epoch,
        references=("https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler",),
        docs=RuleDocs(
            what="A DistributedSampler that shuffles (the default) and feeds a DataLoader which an epoch "
                 "loop of the same file iterates, with no `set_epoch(...)` call anywhere in the file. A "
                 "sampler built in a library function and iterated elsewhere is not judged.",
            why="The sampler seeds its shuffle with seed + epoch, and the epoch stays 0 unless set_epoch is "
                "called: every epoch uses the same order. This is a silent training-quality bug, not a hang: "
                "all ranks still agree, so no runtime failure follows (prevents nothing in the catalog).",
            example="sampler = DistributedSampler(ds)\nfor epoch in range(10):\n    for x in DataLoader(ds, "
                    "sampler=sampler):\n        ...\n",
            fix="Call `sampler.set_epoch(epoch)` at the start of each epoch, before iterating the loader.",
        ),
    ),
    LintRule(
        id="DDP107", name="loader-without-drop-last", severity=Severity.INFO, kind=FileKind.PYTHON,
        title="Training DataLoader over a DistributedSampler keeps a short last batch (BatchNorm model)",
        prevents=("python.exception",), fixture="DDP107_loader_without_drop_last.py",
        check=check_loader_without_drop_last,
        references=("https://pytorch.org/docs/stable/data.html",),
        docs=RuleDocs(
            what="In a file that uses BatchNorm (BatchNorm1d/2d/3d, SyncBatchNorm), a DataLoader whose "
                 "sampler is a shuffling DistributedSampler, with drop_last not True and a batch size other "
                 "than 1. Loaders named for evaluation (val/test/eval) are exempt: BatchNorm runs in eval "
                 "mode there.",
            why="DistributedSampler pads so every rank gets the same number of samples, so the ranks do run "
                "the same number of steps; but the final step of every epoch has a smaller batch on every "
                "rank. When that batch holds one sample, BatchNorm in training mode raises `Expected more "
                "than 1 value per channel` (a ValueError on all ranks) at the end of an epoch. Without "
                "BatchNorm in the file the rule stays silent.",
            example="loader = DataLoader(ds, batch_size=32, sampler=DistributedSampler(ds))\n",
            fix="Pass drop_last=True to the training DataLoader (evaluation loaders may keep the last batch).",
        ),
    ),
)
