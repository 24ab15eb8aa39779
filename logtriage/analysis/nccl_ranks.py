"""Ranks of processes from NCCL's own lines. With NCCL_DEBUG=INFO every NCCL line starts with
`host:pid:tid [cudaDev]`, and set-up lines name the process's communicator rank (`comm 0x...
rank R nranks N`, `Channel 00 : R[busid] -> ...`). A `NCCL WARN` error line of a process whose
lines name one rank only gets that rank; a process seen with several ranks (sub-communicators
whose numbering differs from the world's) gets none."""

from __future__ import annotations

import re
from dataclasses import replace

from logtriage.analysis.findings import Finding

NCCL_PREFIX = re.compile(r"^([\w.-]{1,64}):(\d{1,12}):\d{1,12} \[\d{1,4}\] ")
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
