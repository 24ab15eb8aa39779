"""Second readings of one rule's finding, from the facts beside it: mp.spawn's report of a child
yields to the child's own error under it; NCCL's bootstrap root disagreeing with a peer at one
world size is another NCCL build; a process group "not initialized" on a rank that trained with
the others was destroyed, not never created; a worker killed by SIGKILL after torchelastic's
timer reaped it ran out its timed block (a hang), not out of memory; a store connect that timed
out on a host name whose address could not be resolved failed for that reason; ranks that could not
read a checkpoint (cut short, missing) that another rank failed to write failed for that reason; DDP's
parameter check raised on every rank but rank 0, against rank 0's shapes, blames rank 0."""

from __future__ import annotations

import re
from dataclasses import replace

from logtriage.analysis.findings import Finding
from logtriage.analysis.roots import RootCause, read_as
from logtriage.catalog.loader import Catalog
from logtriage.catalog.rule import Category
from logtriage.rank_ranges import ranges

SPAWN_REPORT_RULE = "launcher.spawn_child_error"
# mp.spawn's report of a child's error: the exception it re-raises, and its header naming the process
SPAWN_RULES = frozenset({SPAWN_REPORT_RULE, "launcher.mp_spawn_raised"})


def spawn_report_yields(root: RootCause, findings: list[Finding]) -> RootCause:
    """mp.spawn's `-- Process N terminated with the following error:` heads the child's own
    traceback; when only consequences were found, the child's own error under it (a peer's closed
    connection, a timeout) says more than the header, and keeps the header's rank."""
    head = root.finding
    if root.rule.id != SPAWN_REPORT_RULE or head is None:
        return root
    own = next((f for f in findings if f.seq > head.seq and f.is_error and not f.is_teardown
                and f.source == head.source and f.rank == head.rank), None)
    if own is None or own.rule.id == SPAWN_REPORT_RULE:
        return root
    return RootCause(own.rule, own, root.rank, root.ranks, root.confidence, root.reasons + (
        f"the child's own error under mp.spawn's report of process {root.rank}",))


def bootstrap_layout_mismatch(root: RootCause, catalog: Catalog) -> RootCause:
    """NCCL's bootstrap root found a process's info other than its own. Another world size
    (`nranks 4 vs 8`) is a launch mistake; the same world size with nonsense beside it (`nranks
    16 vs 16, ... offset -340262910 vs 0`) is a peer whose NCCL build lays that info out
    otherwise: the nodes run different NCCL versions."""
    captures = root.finding.captures if root.finding is not None else {}
    if not captures.get("nranks") or captures.get("nranks") != captures.get("other_nranks"):
        return root
    return read_as(root, catalog, "nccl.version_mismatch", (
        f"the bootstrap root's processes agree on the world size ({captures['nranks']}) but not on the "
        "rest of their info: a peer's NCCL lays it out otherwise, so the nodes run different NCCL builds"))


PG_NOT_INITIALIZED = "dist.pg_not_initialized"


def group_destroyed(root: RootCause, trained: set[int], catalog: Catalog) -> RootCause:
    """`Default process group has not been initialized` on a rank that trained together with other
    ranks (`trained`: the ranks that printed training progress): the group existed, so the program
    destroyed it and went on calling collectives (destroy_process_group before a final barrier, a
    cleanup hook run early), a bug in the program's order, not a launch without init_process_group.
    (A rank that never called init_process_group leaves the others waiting at start-up, before any
    progress; one process trained alone is a run without a launcher.)"""
    if root.rule.id != PG_NOT_INITIALIZED or root.rank not in trained or len(trained) < 2:
        return root
    return read_as(root, catalog, "python.exception", (
        f"rank {root.rank} had trained together with ranks {ranges(sorted(trained - {root.rank}), limit=8)}: the "
        "process group existed and was destroyed before this call (destroy_process_group too early)"))


TIMER_REAPED_RULE = "hang.elastic_timer_expired"


def timer_reaped(root: RootCause, findings: list[Finding]) -> RootCause:
    """A worker's SIGKILL that torchelastic's expiration timer sent: the timer server logs (at INFO
    level) `Reaping worker_pid=[N]. Expired timers: [...]` before it kills the worker, so the
    worker's timed block (a step) hung or crawled."""
    if root.rule.id != "signal.sigkill":
        return root
    reaps = [f for f in findings if f.rule.id == TIMER_REAPED_RULE]
    pid = root.finding.captures.get("pid") if root.finding is not None else None
    reap = next((f for f in reaps if f.captures.get("pid") == pid), reaps[0] if len(reaps) == 1 else None)
    if reap is None:
        return root
    return RootCause(reap.rule, reap, root.rank, root.ranks, 0.7, root.reasons + (
        f"torchelastic's timer reaped the worker (timers {reap.captures.get('timers', '?')} expired) and sent the "
        "SIGKILL: its timed block ran too long",))


CONNECT_RULES = frozenset({"dist.store_connect_timeout", "dist.store_connect_failed"})
NAME_RESOLUTION_RULE = "dist.name_resolution"


def unresolved_host(root: RootCause, findings: list[Finding]) -> RootCause:
    """A store connect that timed out (or failed) to a host name that c10d had already warned it
    could not resolve (`The IPv6 network addresses of (host, port) cannot be retrieved (gai error:
    -2 - Name or service not known)`, a warning c10d retries past): the name does not resolve, so
    the connect could never succeed."""
    if root.rule.id not in CONNECT_RULES or root.finding is None:
        return root
    host = root.finding.captures.get("host", "")   # the connect rules capture the host they tried
    if not host or host[0].isdigit():
        return root
    warned = next((f for f in findings if f.rule.id == NAME_RESOLUTION_RULE and host in f.text), None)
    if warned is None:
        return root
    return RootCause(warned.rule, warned, root.rank, root.ranks, root.confidence, root.reasons + (
        f"the store connect to `{host}` failed after c10d had warned that the name does not resolve",))


SHARED_GPU_RULE = "cuda.ranks_share_gpu"
OOM_HOLDER = re.compile(r"Process (\d+) has ([\d.]+) ([KMGT]iB|bytes) memory in use")
_UNIT = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
WORKING_SET = 2**30   # a rank's model and activations, not a stray CUDA context (300-600 MiB)


def oom_on_shared_gpu(root: RootCause, ranks: int, catalog: Catalog) -> RootCause:
    """A CUDA OOM whose message lists, on the failing GPU, two or more processes with neighbouring
    PIDs that each hold a working set (a GiB or more): workers one launcher started together, so
    the job's own ranks share that GPU. Other ranks' small contexts there (a torch.cuda call before
    set_device) and another job's process stay the OOM (`ranks`: the ranks the log knows)."""
    if root.rule.id != "cuda.oom" or root.finding is None or ranks < 2:
        return root
    heavy = sorted(int(pid) for pid, size, unit in OOM_HOLDER.findall(root.finding.text)
                   if float(size) * _UNIT[unit] >= WORKING_SET)
    if len(heavy) < 2 or heavy[-1] - heavy[0] > 8 * len(heavy):
        return root
    return read_as(root, catalog, SHARED_GPU_RULE, (
        f"the OOM message lists {len(heavy)} processes with neighbouring PIDs ({heavy[0]}-{heavy[-1]}) each holding "
        "a GiB or more on this GPU: the job's own ranks share it"))


# torch/distributed/checkpoint/api.py: `CheckpointException ranks:dict_keys([2])`
_DCP_RANKS = re.compile(r"CheckpointException ranks:\s*(?:dict_keys\()?\[([\d, ]*)\]")


def dcp_named_ranks(root: RootCause, findings: list[Finding], block_exceptions: dict[int, str]) -> RootCause:
    """torch.distributed.checkpoint gathers every rank's failure and raises the same
    `CheckpointException ranks:dict_keys([2])` on all of them (`block_exceptions`: each
    traceback's exception line): the ranks it names are where the load or save failed, whichever
    rank's copy printed first. The root moves to the named rank's own error where it printed one."""
    if root.rule.category is not Category.CHECKPOINT or root.finding is None:
        return root
    named_by_block = {b: {int(r) for r in re.findall(r"\d+", m.group(1))}
                      for b, text in block_exceptions.items() if (m := _DCP_RANKS.search(text))}
    named = set().union(*named_by_block.values()) if named_by_block else set()
    reporters = {f.rank for f in findings if f.block_id in named_by_block and f.rank is not None}
    if not named or (reporters and not reporters - named) or (
            root.rank in named and len(named) == 1 and root.ranks == (root.rank,)):
        return root    # nothing named, or only the failing ranks reported (no rank at all: mp.spawn's children)
    first = min(named)
    own = next((f for f in findings if f.rank == first and f.rule.id == root.rule.id), root.finding)
    return replace(root, finding=own, rank=first if len(named) == 1 else None, ranks=tuple(sorted(named)),
                   reasons=root.reasons + (
                       f"torch.distributed.checkpoint's CheckpointException on every rank names rank(s) "
                       f"{ranges(sorted(named), limit=8)} as the ones that failed",))


# reading a checkpoint that is cut short or not there: what a failed write leaves the readers
_READ_SIDE = frozenset({"ckpt.corrupt_archive", "ckpt.not_found"})
WRITE_FAILED_RULE = "ckpt.write_failed"


def writer_behind_readers(root: RootCause, findings: list[Finding]) -> RootCause:
    """Ranks that cannot read a checkpoint (a truncated archive, a missing file) while another rank
    failed writing one (disk full, an unwritable path, a write cut off): the writer's failure is
    the cause, the readers' errors its consequence (rank 0 saving alone, the others loading)."""
    if root.rule.id not in _READ_SIDE:
        return root
    readers = set(root.ranks) | ({root.rank} if root.rank is not None else set())
    writer = next((f for f in findings if f.rule.id == WRITE_FAILED_RULE and f.is_error and f.rank is not None
                   and f.rank not in readers), None)
    if writer is None:
        return root
    return RootCause(writer.rule, writer, writer.rank, (writer.rank,), root.confidence, (
        f"rank {writer.rank} failed writing a checkpoint; the read failures of rank(s) {ranges(sorted(readers))} "
        f"({root.rule.id}) are what that write left behind",))


# a process's own death by a signal (a native crash, an abort it called), not a stop from outside
_GLOO_SIZE_ABORT = "gloo.size_mismatch"
_OWN_SIGNALS = {"signal.sigsegv": "SIGSEGV", "signal.sigbus": "SIGBUS", "signal.sigabrt": "SIGABRT"}
_WAITING = frozenset({Category.COLLECTIVE_TIMEOUT, Category.COLLECTIVE_ERROR})


def waited_for_a_crash(root: RootCause, findings: list[Finding]) -> RootCause:
    """The rank the others' timeouts point at (a debug report names it, or it is missing from their
    collective) died of a signal of its own and reports no wait of its own: its crash is the root,
    the timeouts its consequence (a monitored barrier names the rank that aborted at once). A
    SIGABRT counts only where NCCL is not in the log (its watchdog aborts timed-out ranks itself)."""
    rank = root.rank
    if root.rule.category is not Category.COLLECTIVE_TIMEOUT or rank is None:
        return root
    if any(f.rank == rank and f.category in _WAITING for f in findings):
        return root
    aborts_on_timeout = any(f.rule.id.startswith("nccl.") for f in findings)
    crash = next((f for f in findings if f.rank == rank and f.rule.id in _OWN_SIGNALS and f.is_error
                  and not (aborts_on_timeout and f.rule.id == "signal.sigabrt")), None)
    if crash is None:
        return root
    if crash.rule.id == "signal.sigabrt":
        # gloo's own abort (`terminate called after throwing ... gloo::EnforceNotMet`, `Received data size
        # doesn't match expected size`), its lines with no rank: why that rank aborted
        told = next((f for f in findings if f.rule.id == _GLOO_SIZE_ABORT and f.rank in (None, rank)
                     and f.source == crash.source and f.line < crash.line), None)
        if told is not None:
            return RootCause(told.rule, told, rank, (rank,), root.confidence, root.reasons + (
                f"rank {rank}, the one the others waited for, aborted on gloo's size check (the data it received "
                f"was of another size) and never waited itself: their wait ({root.rule.id}) is its consequence",))
    return RootCause(crash.rule, crash, rank, (rank,), root.confidence, root.reasons + (
        f"rank {rank}, the one the others waited for, died of {_OWN_SIGNALS[crash.rule.id]} and never waited "
        f"itself: its crash came first, their wait ({root.rule.id}) is its consequence",))


PARAM_SHAPE_RULE = "ddp.param_shape_mismatch"
_AGAINST_RANK0 = "of the same param in process 0"


def rank0_model_differs(root: RootCause, findings: list[Finding], known: frozenset[int]) -> RootCause:
    """DDP's constructor compares every rank's parameter shapes with rank 0's, and a rank whose
    shapes differ raises `params[0] in this process with sizes [...] appears not to match sizes of
    the same param in process 0`. When every rank but rank 0 raises it (three ranks or more), the
    one model that differs is rank 0's (a stale config or file on its node), not theirs."""
    if root.rule.id != PARAM_SHAPE_RULE or root.rank == 0 or len(known) < 3:
        return root
    raised = {f.rank for f in findings if f.rule.id == PARAM_SHAPE_RULE and _AGAINST_RANK0 in f.text}
    if raised != known - {0}:
        return root
    return replace(root, rank=0, ranks=(0,), confidence=min(root.confidence, 0.6), reasons=root.reasons + (
        f"every rank but rank 0 ({ranges(sorted(raised), limit=8)}) found its parameters differ from rank 0's: "
        "the model that differs is rank 0's",))
