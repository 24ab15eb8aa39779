"""Rules about collectives that only some ranks reach: DDP101, DDP102, DDP103."""

from __future__ import annotations

import ast
from collections import Counter
from typing import Callable, Iterator

from logtriage.lint.model import FileKind, Hit, LintRule, RuleDocs, Severity
from logtriage.lint.names import dotted, is_host_sync, on_subgroup
from logtriage.lint.pyfile import PyFile
from logtriage.lint.rankexpr import zero_side
from logtriage.lint.regions import CallSite, Guard, GuardKind, ends_in_exit, innermost
from logtriage.lint.rankio import io_kind

HANG_IDS = ("gloo.timeout", "nccl.watchdog_timeout", "hang.no_progress", "dist.collective_mismatch")


def where(pf: PyFile, guard: Guard) -> str:
    node = guard.node
    if guard.branch == "decorator":
        return f"in `{getattr(node, 'name', '?')}()`, which a rank-only decorator runs on one rank"
    test = pf.source_of(node.test) if isinstance(node, ast.If) else "?"
    return {"body": f"inside `if {test}:` (line {guard.line})",
            "orelse": f"in the else of `if {test}:` (line {guard.line})",
            "after": f"after the rank-dependent early exit `if {test}:` (line {guard.line})"}[guard.branch]


Pick = Callable[[CallSite], "str | None"]
Through = Callable[[CallSite], "tuple[str, str] | None"]


def through_helpers(pf: PyFile, pick: Pick) -> Through:
    """Default search through local helpers: the first call `pick` names that every rank entering
    the helper runs, as (what, " (through f -> g(), line N)")."""
    def search(site: CallSite) -> tuple[str, str] | None:
        for target in pf.graph.resolve(site.call):
            summary = pf.graph.first_unguarded(target, pick)
            if summary:
                chain = " -> ".join([getattr(target, "name", "?"), *summary[2]])
                return summary[0], f" (through {chain}(), line {summary[1]})"
        return None
    return search


def rank_only_uses(pf: PyFile, pick: Pick, skip: Callable[[CallSite], bool] = lambda s: False,
                   through: Through | None = None) -> list[tuple[CallSite, Guard, str, str]]:
    """Calls under a rank guard that run `pick` (directly, or through local helpers as `through`
    finds), after removing those the other branch of the same `if` matches and pairs spread over
    several guards of one function (`if rank != 0: barrier()` ... `if rank == 0: barrier()`)."""
    search = through or through_helpers(pf, pick)
    found: list[tuple[CallSite, Guard, str, str]] = []
    for site in pf.regions.calls:
        guard = innermost(site.guard, GuardKind.RANK)
        if guard is None or skip(site):
            continue
        what, via = pick(site), ""
        if what is None:
            what, via = search(site) or (None, "")
        if what is not None:
            found.append((site, guard, what, via))
    # An if/elif/else chain on ranks where every branch runs the collective is balanced.
    per_branch: dict[tuple[int, str], Counter] = {}
    for site, guard, what, _ in found:
        per_branch.setdefault((id(guard.node), guard.branch), Counter())[what] += 1
    kept = [item for item in found if not _balanced(pf, item[1], item[2], per_branch)]
    # `if rank != 0: barrier()` ... `if rank == 0: barrier()` in one function pair up (the main rank
    # works while the others wait): the same collective under a main-rank guard and an other-ranks guard.
    sides: dict[tuple[int, str], set[bool]] = {}
    for site, guard, what, _ in kept:
        side = guard_side(pf, guard)
        if side is not None:
            sides.setdefault((id(site.scope), what), set()).add(side)
    return [item for item in kept if len(sides.get((id(item[0].scope), item[2]), set())) < 2]


def _branches(pf: PyFile, node: ast.If) -> list[tuple[ast.If, str, list[ast.stmt]]]:
    """The branches of the if/elif/else chain on ranks that `node` belongs to."""
    while True:
        parent = pf.parents.get(id(node))
        if isinstance(parent, ast.If) and parent.orelse == [node] and pf.ranks.splits(parent.test):
            node = parent
        else:
            break
    out = []
    while True:
        out.append((node, "body", node.body))
        if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If) and pf.ranks.splits(node.orelse[0].test):
            node = node.orelse[0]
            continue
        out.append((node, "orelse", node.orelse))
        return out


def _balanced(pf: PyFile, guard: Guard, what: str, per_branch: dict[tuple[int, str], Counter]) -> bool:
    """Every branch of the chain (but those that end in `raise`) runs `what`: all ranks call it."""
    if guard.branch not in ("body", "orelse") or not isinstance(guard.node, ast.If):
        return False
    live = [(id(n), b) for n, b, stmts in _branches(pf, guard.node)
            if not (stmts and isinstance(stmts[-1], ast.Raise))]
    return len(live) > 1 and all(per_branch.get(key, Counter())[what] > 0 for key in live)


def guard_side(pf: PyFile, guard: Guard) -> bool | None:
    """True if the guarded code runs on the main rank, False if on the other ranks, None if unknown."""
    if guard.branch == "decorator" or not isinstance(guard.node, ast.If):
        return True if guard.branch == "decorator" else None
    side = zero_side(guard.node.test, pf.ranks)
    if side is None:
        return None
    if guard.branch == "orelse" or (guard.branch == "after" and ends_in_exit(guard.node.body)):
        return not side
    return side


def check_collective_in_rank_branch(pf: PyFile) -> Iterator[Hit]:
    if not pf.is_distributed:
        return
    for site, guard, what, via in rank_only_uses(pf, pf.collective, skip=lambda s: on_subgroup(s.call)):
        yield Hit(site.call.lineno, pf.col(site.call),
                  f"`{what}` runs {where(pf, guard)}{via}; ranks that skip the branch never join it, "
                  f"so the collective hangs until the process-group timeout")


def _params(helper: ast.AST, call: ast.Call) -> list[str]:
    spec = getattr(helper, "args", None)
    names = [a.arg for a in (spec.posonlyargs + spec.args)] if spec else []
    if names and names[0] in ("self", "cls") and isinstance(call.func, ast.Attribute):
        names = names[1:]
    return names


def _wrapped_search(pf: PyFile, kinds: dict[str, str | None], site: CallSite,
                    depth: int = 0, seen: frozenset[int] = frozenset()) -> tuple[str, int, list[str]] | None:
    """Follow `site` into local helpers, binding each parameter to what the caller passed:
    `evaluate(model)` carries the wrapper, `evaluate(model.module)` / `evaluate(unwrap(model))`
    do not. `kinds` maps the caller's own parameters to the wrapper they carry (None: none)."""
    if depth > 3:
        return None
    for helper in pf.graph.resolve(site.call):
        if id(helper) in seen:
            continue
        params = _params(helper, site.call)
        passed = dict(zip(params, site.call.args)) | {k.arg: k.value for k in site.call.keywords if k.arg}
        inner: dict[str, str | None] = {}
        for name in params:
            arg = dotted(passed[name]) if name in passed else None
            inner[name] = kinds.get(arg) if arg in kinds else pf.wrapped_models.get(arg or "")
        for call in sorted(pf.graph.calls_in(helper), key=lambda c: c.call.lineno):
            if innermost(call.guard, GuardKind.RANK) is not None:
                continue
            name = dotted(call.call.func) or ""
            kind = inner.get(name) if name in inner else (
                None if name.split(".")[0] in inner else pf.wrapped_models.get(name))
            if kind:
                return f"{kind}-wrapped `{name}`", call.call.lineno, [helper.name]
            deeper = _wrapped_search(pf, inner, call, depth + 1, seen | {id(helper)})
            if deeper:
                return deeper[0], deeper[1], [helper.name, *deeper[2]]
    return None


def check_wrapped_forward_in_rank_branch(pf: PyFile) -> Iterator[Hit]:
    if not pf.wrapped_models:
        return
    def through(site: CallSite) -> tuple[str, str] | None:
        found = _wrapped_search(pf, {}, site)
        return (found[0], f" (through {' -> '.join(found[2])}(), line {found[1]})") if found else None

    uses = rank_only_uses(pf, pf.wrapped_forward, through=through)
    for site, guard, what, via in uses:
        detail = ("FSDP all-gathers parameters in every forward" if what.startswith("FSDP")
                  else "DDP broadcasts the module's buffers, if it has any, at the start of forward")
        yield Hit(site.call.lineno, pf.col(site.call),
                  f"forward of {what} runs {where(pf, guard)}{via}; {detail}, a collective the other "
                  f"ranks never join; call the unwrapped module (`.module`) for one-rank evaluation")


def _following_calls(pf: PyFile, block) -> Iterator[CallSite]:
    ids = {id(n) for stmt in block.following for n in ast.walk(stmt)}
    sites = [s for s in pf.regions.calls
             if s.scope is block.scope and id(s.call) in ids and innermost(s.guard, GuardKind.RANK) is None]
    yield from sorted(sites, key=lambda s: (s.call.lineno, s.call.col_offset))


def check_rank0_io_then_collective(pf: PyFile) -> Iterator[Hit]:
    if not pf.is_distributed:
        return
    for block in pf.regions.blocks:
        if innermost(block.guard.parent, GuardKind.RANK) is not None:
            continue   # the whole `if` is already rank-only; DDP101 covers what follows
        io = next(((kind, call) for stmt in block.stmts for call in ast.walk(stmt)
                   if isinstance(call, ast.Call) and (kind := io_kind(pf, call))), None)
        if io is None:
            continue
        for site in _following_calls(pf, block):
            name, line = pf.collective(site), site.call.lineno
            if name is None:
                for target in pf.graph.resolve(site.call):
                    summary = pf.graph.first_unguarded(target, pf.collective)
                    if summary:
                        name, line = summary[0], summary[1]
                        break
            if name is None:
                continue
            if not is_host_sync(name):
                kind, call = io
                yield Hit(block.node.lineno, pf.col(block.node),
                          f"rank-only block does {kind} (`{pf.source_of(call.func)}`, line {call.lineno}) and "
                          f"then every rank enters `{name}` (line {line}) with no barrier between; the "
                          f"collective's timeout runs while the I/O does, and a timeout names `{name}`, not "
                          f"the I/O")
            break


RULES = (
    LintRule(
        id="DDP101", name="collective-in-rank-branch", severity=Severity.ERROR, kind=FileKind.PYTHON,
        title="Collective inside a branch that only some ranks take",
        prevents=HANG_IDS, fixture="DDP101_collective_in_rank_branch.py",
        check=check_collective_in_rank_branch,
        references=("seed:ddp-rules", "seed:colossalai-ch11 (NCCL hang: ranks took different branches)"),
        docs=RuleDocs(
            what="A collective (all_reduce, barrier, broadcast, all_gather, reduce_scatter, new_group, ...) "
                 "called inside `if rank == 0:` / `if is_main_process:` / after `if rank != 0: return`, "
                 "directly or through a helper defined in the same file, without the other branch running "
                 "the same collective.",
            why="Every rank of the group must call every collective in the same order. The ranks that skip "
                "the branch never enter it, so the ranks inside wait until the process-group timeout "
                "(gloo: `Timed out waiting ... for recv`; NCCL: watchdog timeout) or, if the others have "
                "moved on to a different collective, pair it with the wrong one (desync, size mismatch).",
            example="if dist.get_rank() == 0:\n    dist.all_reduce(metric)   # ranks 1..N never call this\n",
            fix="Call the collective on every rank and keep only the rank-specific work in the branch:\n"
                "dist.all_reduce(metric)\nif dist.get_rank() == 0:\n    print(metric.item())\n"
                "Collectives on an explicit subgroup (`group=`) are exempt.",
        ),
    ),
    LintRule(
        id="DDP102", name="rank0-io-then-collective", severity=Severity.WARNING, kind=FileKind.PYTHON,
        title="Rank-0-only I/O followed by a collective without a barrier",
        prevents=("nccl.watchdog_timeout", "gloo.timeout", "ckpt.not_found"),
        fixture="DDP102_rank0_io_then_collective.py", check=check_rank0_io_then_collective,
        references=("seed:ddp-rules (rule 1: barrier around rank-0-only I/O)",),
        docs=RuleDocs(
            what="A branch only some ranks take writes TensorBoard/W&B/MLflow logs, a checkpoint or files, "
                 "or downloads/preprocesses data, and the next collective after it is not a barrier.",
            why="While rank 0 does the I/O, the other ranks are already inside the next collective and its "
                "timeout is running. A slow file system, a W&B network retry or a long preprocessing step "
                "turns into a collective timeout that names an unrelated all_reduce, and readers of what "
                "rank 0 wrote are not ordered after the write.",
            example="if rank == 0:\n    wandb.log({'loss': loss})\ndist.all_reduce(grad_norm)\n",
            fix="Put `dist.barrier()` after the rank-only block (and before it if the block reads state the "
                "others are still producing), so the wait is explicit and a timeout points at the I/O; do "
                "long preprocessing before `init_process_group` or raise the timeout for it.",
        ),
    ),
    LintRule(
        id="DDP103", name="wrapped-forward-in-rank-branch", severity=Severity.WARNING, kind=FileKind.PYTHON,
        title="DDP/FSDP-wrapped model called on only some ranks (evaluation on rank 0)",
        prevents=HANG_IDS, fixture="DDP103_wrapped_forward_in_rank_branch.py",
        check=check_wrapped_forward_in_rank_branch,
        references=("https://pytorch.org/docs/stable/notes/ddp.html",),
        docs=RuleDocs(
            what="A model wrapped in DistributedDataParallel or FSDP is called inside a rank-only branch, "
                 "typically `if rank == 0: evaluate(model)`.",
            why="FSDP all-gathers parameters in every forward. DDP broadcasts module buffers (BatchNorm "
                "statistics, registered buffers) from rank 0 at the start of a forward when "
                "broadcast_buffers=True (the default). Those are collectives the other ranks never join: rank "
                "0 hangs, or pairs the broadcast with the other ranks' next collective.",
            example="if rank == 0:\n    model.eval()\n    val_loss = model(val_x)   # model = DDP(net)\n",
            fix="Evaluate on every rank and reduce the metric, or call the unwrapped module on rank 0 "
                "(`model.module(val_x)`); for FSDP, evaluate on all ranks. DDP built with "
                "broadcast_buffers=False is exempt.",
        ),
    ),
)
