"""Who writes each line: nodes, agents, workers, their pids, and the prefixes each style adds.

One torchrun agent per node, `ranks_per_node` workers each (global rank = node * rpn + local).
Prefix layers follow FORMATS.md §2 and §13.1, outermost first:

    srun --label      `<node>: ` on every line of that node (width of the largest task id)
    torchrun --tee 3  `[default<local_rank>]:` on every worker line (not on agent lines)
    excepthook        `[rank<R>]: ` on uncaught tracebacks (empty lines stay bare)
    c10 logging       `[rank<R>]:[I1130 00:01:08.161225451 file.cpp:N] `
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.loggen.spec import GenSpec, Style

# PCI bus ids of an 8-GPU SXM board, by local device index.
_BUS_IDS = ("18000", "2a000", "3a000", "5d000", "9a000", "ab000", "ba000", "db000")


@dataclass(frozen=True)
class Worker:
    rank: int
    local: int
    node: int
    pid: int
    host: str
    bus_id: str
    comm: str          # the NCCL communicator address this rank prints
    out: str           # prefix of a plain stdout/stderr line (user print, logging, NCCL, native)
    exc: str           # prefix of an uncaught-traceback line
    exc_empty: str     # what an empty line inside a traceback becomes
    cpp: str           # prefix up to and including the `[` of a c10 log header


@dataclass(frozen=True)
class Agent:
    node: int
    pid: int
    host: str
    out: str           # prefix of the agent's own lines (py-glog, its traceback, ChildFailedError)


class Topology:
    """Every worker and agent of one job, with fixed pids drawn from the seed."""

    def __init__(self, spec: GenSpec, rng: random.Random):
        self.spec = spec
        rpn = spec.ranks_per_node
        width = len(str(max(spec.nodes - 1, 0)))
        self.agents: list[Agent] = []
        self.workers: list[Worker] = []
        for node in range(spec.nodes):
            host = f"node-{node:03d}"
            label = f"{node:>{width}}: " if spec.style is Style.SRUN else ""
            agent_pid = rng.randrange(2_000, 90_000)
            self.agents.append(Agent(node, agent_pid, host, label))
            first_pid = agent_pid + rng.randrange(15, 60)
            for local in range(rpn):
                rank = node * rpn + local
                if rank >= spec.ranks:
                    break
                tee = f"[default{local}]:" if spec.style is Style.TEE else ""
                out = label + tee
                self.workers.append(Worker(
                    rank=rank, local=local, node=node, pid=first_pid + local, host=host,
                    bus_id=_BUS_IDS[local % len(_BUS_IDS)],
                    comm=f"0x{rng.randrange(0x55a000000000, 0x55ffffffffff) & ~0xF:x}",
                    out=out, exc=f"{out}[rank{rank}]: ", exc_empty=out, cpp=f"{out}[rank{rank}]:[",
                ))

    @property
    def world(self) -> int:
        return self.spec.ranks

    def node_workers(self, node: int) -> list[Worker]:
        return [w for w in self.workers if w.node == node]

    def nccl_head(self, worker: Worker, tid_offset: int = 0) -> str:
        """`node-003:12372:12372 [3] NCCL INFO ` (libnccl's own debug prefix, after `out`)."""
        return f"{worker.out}{worker.host}:{worker.pid}:{worker.pid + tid_offset} [{worker.local}] NCCL INFO "


def permutation_pool(world: int, rng: random.Random, count: int = 257) -> list[tuple[int, ...]]:
    """Precomputed arrival orders of the ranks' step lines (shuffling per step costs too much)."""
    pool = []
    base = list(range(world))
    for _ in range(count):
        rng.shuffle(base)
        pool.append(tuple(base))
    return pool
