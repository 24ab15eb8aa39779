"""Ranks of processes from NCCL's own lines. With NCCL_DEBUG=INFO every NCCL line starts with
`host:pid:tid [cudaDev]`, and set-up lines name the process's communicator rank (`comm 0x...
rank R nranks N`, `Channel 00 : R[busid] -> ...`). A `NCCL WARN` error line of a process whose
lines name one rank only gets that rank; a process seen with several ranks (sub-communicators
whose numbering differs from the world's) gets none. The same summaries show two processes on
one GPU."""

from __future__ import annotations

from dataclasses import replace

from logtriage.analysis.findings import Finding
from logtriage.analysis.roots import RootCause
from logtriage.catalog.loader import Catalog
from logtriage.catalog.rule import Category
from logtriage.demux.blocks import NCCL_PREFIX

SETUP_RULE = "context.nccl_init_progress"   # the NCCL set-up lines: Bootstrap, comm rank, channel


def attribute_by_nccl_pid(findings: list[Finding]) -> list[Finding]:
    claims: dict[tuple[str, str], set[int]] = {}
    for f in findings:
        value = f.captures.get("comm_rank", "")
        m = NCCL_PREFIX.match(f.text) if f.rule.id == SETUP_RULE and value.isdigit() else None
        if m:
            claims.setdefault((m.group(1), m.group(2)), set()).add(int(value))
    if not claims:
        return findings
    out = []
    for f in findings:
        m = NCCL_PREFIX.match(f.text) if f.rank is None and f.is_error else None
        ranks = claims.get((m.group(1), m.group(2)), set()) if m else set()
        out.append(replace(f, rank=next(iter(ranks)), attributed_by="nccl") if len(ranks) == 1 else f)
    return out


DUPLICATE_GPU_RULE = "nccl.duplicate_gpu"


def shared_gpu(root: RootCause | None, findings: list[Finding], catalog: Catalog) -> RootCause | None:
    """A failure the log does not explain, where NCCL's communicator summaries (`comm 0x... rank 1
    nranks 2 cudaDev 0 busId 19000`) show two processes of one host on the same GPU: the device
    assignment put two ranks on one GPU, which NCCL refuses ("Duplicate GPU detected")."""
    if root is not None and root.rule.category is not Category.UNKNOWN:
        return root
    by_gpu: dict[tuple[str, str, str], dict[str, Finding]] = {}
    for f in findings:
        m = NCCL_PREFIX.match(f.text) if f.rule.id == SETUP_RULE and f.captures.get("bus_id") else None
        if m and f.captures.get("comm_rank", "").isdigit():
            key = (m.group(1), f.captures.get("nranks", ""), f.captures["bus_id"])
            by_gpu.setdefault(key, {}).setdefault(m.group(2), f)    # one per process (pid)
    shared = next((procs for procs in by_gpu.values()
                   if len({f.captures["comm_rank"] for f in procs.values()}) > 1), None)
    rule = catalog.get(DUPLICATE_GPU_RULE)
    if shared is None or rule is None:
        return root
    first = min(shared.values(), key=lambda f: f.seq)
    ranks = tuple(sorted({int(f.captures["comm_rank"]) for f in shared.values()}))
    return RootCause(rule, first, None, ranks, 0.5, (
        f"NCCL's communicator summaries show ranks {', '.join(map(str, ranks))} in different processes on one "
        f"GPU (busId {first.captures['bus_id']}): two ranks were given the same device",))
