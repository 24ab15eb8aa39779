"""The start of a job's console: container banner, launcher OMP banner, probes, NCCL init.

Texts follow FORMATS.md §2.1 (py-glog OMP banner), §11 (c10 log shape) and public NCCL_DEBUG=INFO
logs (`host:pid:tid [dev] NCCL INFO ...`). Versions are those of a recent NGC PyTorch image.
"""

from __future__ import annotations

import json
import random

from benchmarks.loggen.clock import SimClock
from benchmarks.loggen.layout import Agent, Topology, Worker
from benchmarks.loggen.writer import LogWriter

TORCH_VERSION = "2.6.0a0+ecf3bae"
NCCL_VERSION = "2.25.1"
CUDA_VERSION = "12.8"
IMAGE_RELEASE = "25.01"
SITE = "/usr/local/lib/python3.12/dist-packages"

_OMP_TEXT = ("Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid "
             "your system being overloaded, please further tune the variable for optimal performance in "
             "your application as needed. ")


def container_banner(build: int) -> list[str]:
    return [
        "",
        "=============",
        "== PyTorch ==",
        "=============",
        "",
        f"NVIDIA Release {IMAGE_RELEASE} (build {build})",
        f"PyTorch Version {TORCH_VERSION}",
        "",
        "Container image Copyright (c) 2025, NVIDIA CORPORATION & AFFILIATES. All rights reserved.",
        "",
        "Copyright (c) 2014-2024 Facebook Inc.",
        "All rights reserved.",
        "",
        "Various files include modifications (c) NVIDIA CORPORATION & AFFILIATES.  All rights reserved.",
        "",
        "This container image and its contents are governed by the NVIDIA Deep Learning Container License.",
        "By pulling and using the container, you accept the terms and conditions of this license:",
        "https://developer.nvidia.com/ngc/nvidia-deep-learning-container-license",
        "",
        "NOTE: CUDA Forward Compatibility mode ENABLED.",
        "  Using CUDA 12.8 driver version 570.86.10 with kernel driver version 550.127.08.",
        "  See https://docs.nvidia.com/deploy/cuda-compatibility/ for details.",
        "",
    ]


def agent_line(clock: SimClock, agent: Agent, level: str, where: str, message: str) -> str:
    """One py-glog line of the launcher: `W1130 00:01:08.161000 8232 torch/...:874] message`."""
    return f"{agent.out}{clock.py_glog(level)} {agent.pid} {where}] {message}"


def omp_banner(clock: SimClock, agent: Agent) -> list[str]:
    where = "torch/distributed/run.py:792"
    return [agent_line(clock, agent, "W", where, m) for m in
            ("", "*****************************************", _OMP_TEXT, "*****************************************")]


def probe_line(worker: Worker, world: int, digest: str) -> str:
    facts = {
        "schema": 1, "rank": worker.rank, "local_rank": worker.local, "world_size": world,
        "torch": TORCH_VERSION, "cuda": CUDA_VERSION, "nccl": NCCL_VERSION, "python": "3.12.3",
        "driver": "570.86.10", "gpu": "NVIDIA H100 80GB HBM3", "gpu_count": 8,
        "image": f"pytorch:{IMAGE_RELEASE}-py3", "image_digest": digest,
    }
    return worker.out + "LOGTRIAGE_ENVIRONMENT_JSON=" + json.dumps(facts, separators=(",", ":"))


def nccl_init(topo: Topology, worker: Worker, rng: random.Random, comm_id: str, clock: SimClock) -> list[str]:
    """A rank's NCCL_DEBUG=INFO lines while its default communicator is created."""
    head = topo.nccl_head(worker)
    thread = topo.nccl_head(worker, tid_offset=rng.randrange(200, 900))
    world = topo.world
    nxt, prv = (worker.rank + 1) % world, (worker.rank - 1) % world
    nxt_local = nxt % topo.spec.ranks_per_node
    lines = []
    if worker.rank == 0:
        lines.append(f"{worker.out}NCCL version {NCCL_VERSION}+cuda{CUDA_VERSION}")
    lines += [
        f"{head}Bootstrap : Using eth0:10.{worker.node // 250}.{worker.node % 250}.{10 + worker.local}<0>",
        f"{head}cudaDriverVersion 12080",
        f"{head}NET/Plugin: Using internal network plugin.",
        f"{thread}NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [2]mlx5_2:1/IB [3]mlx5_3:1/IB ; OOB eth0:10.0.0.1<0>",
        f"{thread}Using network IB",
        f"{thread}ncclCommInitRank comm {worker.comm} rank {worker.rank} nranks {world} cudaDev {worker.local} "
        f"nvmlDev {worker.local} busId {worker.bus_id} commId {comm_id} - Init START",
        f"{thread}Setting affinity for GPU {worker.local} to ffff,ffffffff",
        f"{thread}Trees [0] {nxt}/-1/-1->{worker.rank}->{prv} [1] {nxt}/-1/-1->{worker.rank}->{prv}",
    ]
    via = "P2P/IPC" if nxt // topo.spec.ranks_per_node == worker.node else "NET/IB/0/GDRDMA"
    for channel in range(8):
        lines.append(f"{thread}Channel {channel:02d}/0 : {worker.rank}[{worker.local}] -> "
                     f"{nxt}[{nxt_local}] via {via}")
    lines += [
        f"{thread}Connected all rings",
        f"{thread}Connected all trees",
        f"{thread}threadThresholds 8/8/64 | 512/8/64 | 512 | 512",
        f"{thread}24 coll channels, 24 collnet channels, 0 nvls channels, 32 p2p channels, 32 p2p channels per peer",
        f"{thread}ncclCommInitRank comm {worker.comm} rank {worker.rank} nranks {world} cudaDev {worker.local} "
        f"nvmlDev {worker.local} busId {worker.bus_id} commId {comm_id} - Init COMPLETE",
    ]
    return lines


def cpp_init(clock: SimClock, worker: Worker, world: int, timeout_ms: int) -> list[str]:
    pg = f"[PG ID 0 PG GUID 0(default_pg) Rank {worker.rank}]"
    return [
        f"{worker.cpp}{clock.cpp_glog('I', worker.rank * 7919)} ProcessGroupNCCL.cpp:915] {pg} "
        f"ProcessGroupNCCL initialization options: size: {world}, global rank: {worker.rank}, "
        f"TIMEOUT(ms): {timeout_ms}, USE_HIGH_PRIORITY_STREAM: 0, SPLIT_FROM: 0, SPLIT_COLOR: -2, PG Name: 0",
        f"{worker.cpp}{clock.cpp_glog('I', worker.rank * 104729)} ProcessGroupNCCL.cpp:924] {pg} "
        f"ProcessGroupNCCL environments: NCCL version: {NCCL_VERSION}, TORCH_NCCL_ASYNC_ERROR_HANDLING: 3, "
        "TORCH_NCCL_DUMP_ON_TIMEOUT: 1, TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC: 60000, "
        "TORCH_NCCL_DESYNC_DEBUG: 1, TORCH_NCCL_ENABLE_TIMING: 0, TORCH_NCCL_BLOCKING_WAIT: 0",
    ]


def write_preamble(w: LogWriter, topo: Topology, clock: SimClock, rng: random.Random,
                   with_banner: bool, timeout_ms: int) -> None:
    """Everything before step 1, node by node as the processes start (blocks, not lines)."""
    build = rng.randrange(100_000_000, 200_000_000)
    digest = "sha256:" + "".join(rng.choice("0123456789abcdef") for _ in range(64))
    comm_id = f"0x{rng.getrandbits(64):x}"
    for agent in topo.agents:
        if with_banner:
            w.block([agent.out + line if agent.out else line for line in container_banner(build)])
        w.block(omp_banner(clock, agent))
        clock.advance(rng.randrange(20_000, 90_000))
    clock.advance(3_000_000)
    w.block([probe_line(worker, topo.world, digest) for worker in topo.workers])
    clock.advance(1_500_000)
    for worker in topo.workers:
        w.block(nccl_init(topo, worker, rng, comm_id, clock))
        w.block(cpp_init(clock, worker, topo.world, timeout_ms))
        clock.advance(rng.randrange(500, 4_000))
