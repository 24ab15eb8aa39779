"""Checkpoint rules: CKP301-CKP304."""

from __future__ import annotations

import ast
import re
from typing import Iterator

from logtriage.lint.flow import expands, same_path, untrusted_origin
from logtriage.lint.model import FileKind, Hit, LintRule, RuleDocs, Severity
from logtriage.lint.names import has_star_kwargs, is_const, is_host_sync, kwarg
from logtriage.lint.pyfile import PyFile
from logtriage.lint.regions import CallSite, GuardKind, innermost

CHECKPOINTISH = re.compile(r"ckpt|checkpoint|resume|pretrain|state_dict|weights|snapshot", re.I)


def _save_dest(pf: PyFile, call: ast.Call) -> ast.expr | None:
    qual = pf.qual(call)
    if qual in ("torch.save", "safetensors.torch.save_file"):
        return call.args[1] if len(call.args) > 1 else kwarg(call, "f") or kwarg(call, "filename")
    if isinstance(call.func, ast.Attribute) and call.func.attr == "save_pretrained" and call.args:
        return None if kwarg(call, "is_main_process") is not None else call.args[0]
    return None


def _in_memory(pf: PyFile, dest: ast.expr, site: CallSite) -> bool:
    return any(isinstance(n, ast.Call) and pf.qual(n).endswith("BytesIO")
               for e in expands(pf, dest, site.scope) for n in ast.walk(e))


def check_save_on_every_rank(pf: PyFile) -> Iterator[Hit]:
    if not pf.is_distributed or not pf.runs_ranks:
        return
    for site in pf.regions.calls:
        dest = _save_dest(pf, site.call)
        guarded = innermost(site.guard, GuardKind.RANK) or innermost(site.guard, GuardKind.SINGLE)
        if dest is None or guarded:
            continue
        if not pf.graph.reached_by_all(site.scope) or _in_memory(pf, dest, site):
            continue
        if any(pf.ranks.contains_rank_value(e) for e in expands(pf, dest, site.scope)):
            continue   # one file per rank
        yield Hit(site.call.lineno, pf.col(site.call),
                  f"`{pf.source_of(site.call.func)}` to `{pf.source_of(dest)}` runs on every rank: all ranks "
                  f"write the same file at once; guard it with `if rank == 0:` (then barrier before readers)")


def check_save_then_read_without_barrier(pf: PyFile) -> Iterator[Hit]:
    if "save" not in pf.text:
        return
    for block in pf.regions.blocks:
        saves = [(n, _save_dest(pf, n)) for stmt in block.stmts for n in ast.walk(stmt) if isinstance(n, ast.Call)]
        saves = [(call, dest) for call, dest in saves if dest is not None]
        if not saves:
            continue
        end = block.node.end_lineno or block.node.lineno
        later = sorted((s for s in pf.graph.calls_in(block.scope) if s.call.lineno > end
                        and not _same_ranks(s, block)), key=lambda s: s.call.lineno)
        for save, dest in saves:
            for site in later:
                name = pf.collective(site)
                if name and is_host_sync(name):
                    break
                read = _read_path(pf, site.call)
                if read is not None and same_path(read, dest):
                    yield Hit(site.call.lineno, pf.col(site.call),
                              f"`{pf.source_of(read)}` is read here by ranks that did not write it (written "
                              f"under `if {pf.source_of(block.node.test)}:`, line {save.lineno}) with no "
                              f"barrier between; they can read it before it exists or while it is half written")
                    break


def _same_ranks(site: CallSite, block) -> bool:
    """The reader sits under the same rank test as the writer (`if rank == 0:` twice): it reads
    its own write. Readers in other branches, or under no rank test, are other ranks."""
    guard = innermost(site.guard, GuardKind.RANK)
    return (guard is not None and isinstance(guard.node, ast.If) and guard.branch == block.branch
            and ast.dump(guard.node.test) == ast.dump(block.node.test))


def _read_path(pf: PyFile, call: ast.Call) -> ast.expr | None:
    qual = pf.qual(call)
    if qual in ("torch.load", "safetensors.torch.load_file") or qual.endswith(".from_pretrained"):
        return call.args[0] if call.args else kwarg(call, "f")
    if qual == "open" and call.args:
        mode = call.args[1] if len(call.args) > 1 else kwarg(call, "mode")
        if mode is None or (isinstance(mode, ast.Constant) and "r" in str(mode.value)):
            return call.args[0]
    return None


def check_load_without_map_location(pf: PyFile) -> Iterator[Hit]:
    if not pf.uses_gpus:
        return
    for site in pf.regions.calls:
        call = site.call
        if pf.qual(call) != "torch.load" or len(call.args) > 1 or kwarg(call, "map_location") is not None:
            continue
        if has_star_kwargs(call) or innermost(site.guard, GuardKind.SINGLE) is not None:
            continue
        src = call.args[0] if call.args else kwarg(call, "f")
        if src is None or _mapped_in_other_branch(pf, site, src) or _in_memory(pf, src, site):
            continue
        if not (any(CHECKPOINTISH.search(ast.unparse(e)) for e in expands(pf, src, site.scope))
                or _feeds_load_state_dict(pf, site)):
            continue
        yield Hit(call.lineno, pf.col(call),
                  f"`torch.load({pf.source_of(src)})` without map_location in multi-GPU code: tensors saved "
                  f"from cuda:0 land on cuda:0 in every rank; pass map_location (\"cpu\" or this rank's device)")


def _feeds_load_state_dict(pf: PyFile, site: CallSite) -> bool:
    """The loaded object ends up in `load_state_dict(...)`: directly, or through a variable of the
    same function (`ckpt = torch.load(p)` ... `model.load_state_dict(ckpt["model"])`)."""
    node = pf.parents.get(id(site.call))
    while node is not None and not isinstance(node, ast.stmt):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load_state_dict":
            return True
        node = pf.parents.get(id(node))
    if not isinstance(site.stmt, ast.Assign):
        return False
    names = {t.id for t in site.stmt.targets if isinstance(t, ast.Name)}
    return any(isinstance(other.call.func, ast.Attribute) and other.call.func.attr == "load_state_dict"
               and any(isinstance(n, ast.Name) and n.id in names for a in other.call.args for n in ast.walk(a))
               for other in pf.graph.calls_in(site.scope))


def _mapped_in_other_branch(pf: PyFile, site: CallSite, src: ast.expr) -> bool:
    """`if args.gpu is None: torch.load(p)  else: torch.load(p, map_location=loc)`: the author
    maps where it matters and leaves the other case unmapped on purpose."""
    node, child = pf.parents.get(id(site.stmt)), site.stmt
    while node is not None and not isinstance(node, ast.If):
        node, child = pf.parents.get(id(node)), node
    if node is None:
        return False
    other = node.orelse if any(child is s for s in node.body) else node.body
    return any(isinstance(n, ast.Call) and pf.qual(n) == "torch.load" and n.args and same_path(n.args[0], src)
               and (kwarg(n, "map_location") is not None or len(n.args) > 1)
               for stmt in other for n in ast.walk(stmt))


def check_weights_only_false(pf: PyFile) -> Iterator[Hit]:
    if "weights_only" not in pf.text:
        return
    for site in pf.regions.calls:
        call = site.call
        if pf.qual(call) != "torch.load" or not is_const(kwarg(call, "weights_only"), False):
            continue
        src = call.args[0] if call.args else kwarg(call, "f")
        origin = untrusted_origin(pf, src, site.scope) if src is not None else None
        if origin:
            yield Hit(call.lineno, pf.col(call),
                      f"`torch.load(..., weights_only=False)` on a path from {origin}: unpickling runs "
                      f"arbitrary code from that file; keep weights_only=True and allow-list classes with "
                      f"torch.serialization.add_safe_globals")


RULES = (
    LintRule(
        id="CKP301", name="save-on-every-rank", severity=Severity.ERROR, kind=FileKind.PYTHON,
        title="Checkpoint written by every rank to the same path",
        prevents=("ckpt.corrupt_archive", "ckpt.not_found"), fixture="CKP301_save_on_every_rank.py",
        check=check_save_on_every_rank,
        references=("seed:ddp-rules (CI check: torch.save outside a local_rank == 0 guard)",),
        docs=RuleDocs(
            what="`torch.save`, safetensors `save_file` or `save_pretrained` (without is_main_process=) in "
                 "a file that runs as several ranks (it starts a process group, wraps a model in DDP/FSDP or "
                 "reads the rank), reached by every rank (module code or a function every rank calls), not "
                 "under a rank guard, to a path that does not contain the rank. Helpers called only from "
                 "guarded code, single-process branches and in-memory buffers are exempt.",
            why="N processes open and write the same file at once. On a shared file system the result is an "
                "interleaved or truncated zip archive; the next load fails with `PytorchStreamReader failed "
                "reading zip archive` or finds no file while another rank is replacing it.",
            example="for epoch in range(epochs):\n    train_one_epoch(model)\n"
                    "    torch.save(model.state_dict(), 'ckpt.pt')   # all ranks\n",
            fix="if dist.get_rank() == 0:\n    torch.save(model.module.state_dict(), 'ckpt.pt')\ndist.barrier()\n"
                "For sharded state (FSDP), use torch.distributed.checkpoint, which every rank calls.",
        ),
    ),
    LintRule(
        id="CKP302", name="read-before-barrier", severity=Severity.ERROR, kind=FileKind.PYTHON,
        title="File written on one rank is read by all ranks without a barrier between",
        prevents=("ckpt.not_found", "ckpt.corrupt_archive", "python.file_not_found"),
        fixture="CKP302_read_before_barrier.py", check=check_save_then_read_without_barrier,
        references=("https://pytorch.org/tutorials/intermediate/ddp_tutorial.html#save-and-load-checkpoints",),
        docs=RuleDocs(
            what="A checkpoint saved inside a rank-only branch and later loaded (`torch.load`, `open`, "
                 "`from_pretrained`) from the same path by every rank in the same function, with no "
                 "`dist.barrier()` (or another host-synchronising collective) between the two.",
            why="The ranks that did not write reach the load immediately, while rank 0 may still be writing: "
                "they read a missing file or a half-written archive and crash, and their peers then die of "
                "closed connections.",
            example="if rank == 0:\n    torch.save(model.state_dict(), path)\n"
                    "model.load_state_dict(torch.load(path, map_location=dev))   # ranks 1..N: not there yet\n",
            fix="Put `dist.barrier()` between the guarded save and the load.",
        ),
    ),
    LintRule(
        id="CKP303", name="load-without-map-location", severity=Severity.WARNING, kind=FileKind.PYTHON,
        title="Checkpoint loaded without map_location in multi-GPU code",
        prevents=("cuda.oom", "cuda.invalid_device_ordinal"), fixture="CKP303_load_without_map_location.py",
        check=check_load_without_map_location,
        references=("https://pytorch.org/docs/stable/generated/torch.load.html",),
        docs=RuleDocs(
            what="`torch.load(path)` with no map_location, in a file that runs distributed on GPUs (it "
                 "mentions cuda or nccl), of a checkpoint: the path names one (ckpt, checkpoint, resume, "
                 "pretrained, weights, state_dict, snapshot) or the result goes into `load_state_dict`. A "
                 "load whose sibling branch maps the same path is left alone (a deliberate choice).",
            why="torch.load restores each tensor to the device it was saved from. A checkpoint saved on "
                "cuda:0 is loaded onto cuda:0 by all N ranks: GPU 0 runs out of memory, or a job with fewer "
                "GPUs than the saver fails on a device ordinal that does not exist.",
            example="state = torch.load(args.resume)\n",
            fix="state = torch.load(args.resume, map_location='cpu')   # or f'cuda:{local_rank}'\n",
        ),
    ),
    LintRule(
        id="CKP304", name="weights-only-false-untrusted", severity=Severity.WARNING, kind=FileKind.PYTHON,
        title="torch.load(weights_only=False) on a path from outside the program",
        prevents=(), helps_diagnose=("ckpt.weights_only",), fixture="CKP304_weights_only_false_untrusted.py",
        check=check_weights_only_false,
        references=("https://pytorch.org/docs/stable/notes/serialization.html#weights-only",),
        docs=RuleDocs(
            what="`torch.load(..., weights_only=False)` where the path comes from a URL or download, a "
                 "command-line argument, an environment variable or user input.",
            why="weights_only=False unpickles the file, which can run arbitrary code. It is the usual "
                "workaround for `Weights only load failed` (catalog ckpt.weights_only), and it is safe only "
                "for files the program itself wrote. This is a security rule: it prevents no crash.",
            example="ckpt = torch.load(args.pretrained, weights_only=False)\n",
            fix="Keep weights_only=True and allow-list the classes the checkpoint needs with "
                "`torch.serialization.add_safe_globals([...])`, or convert the checkpoint to safetensors.",
        ),
    ),
)
