"""The consequences: NCCL watchdog timeouts and aborts, the agents' lines, the ChildFailedError.

Watchdog texts follow FORMATS.md §11 (templates from source and public logs); the agent lines
§5; the ChildFailedError block §4 exactly (border width, trailing spaces, field padding, the
root cause keeping its own `[idx]`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.loggen.clock import SimClock
from benchmarks.loggen.layout import Agent, Worker
from benchmarks.loggen.preamble import SITE, agent_line

SIGNALS = {-15: "SIGTERM", -9: "SIGKILL", -6: "SIGABRT"}
BINARY = "/usr/bin/python3"
ENTRYPOINT = "train.py"
_TORCH_LIB = f"{SITE}/torch/lib"
_ERRORS_URL = "https://pytorch.org/docs/stable/elastic/errors.html"


@dataclass(frozen=True)
class ExitRecord:
    worker: Worker
    exitcode: int
    time: str


def _frames(rng: random.Random, lib: str) -> list[str]:
    base = 0x7f0000000000 + (rng.getrandbits(28) << 12)
    return [
        f"frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x{base + 0x96c1b6:x} in {_TORCH_LIB}/libc10.so)",
        f"frame #1: c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout(std::optional<std::chrono::duration<long, "
        f"std::ratio<1l, 1000l> > >) + 0x2b4 (0x{base + 0x41bc74:x} in {_TORCH_LIB}/{lib})",
        f"frame #2: c10d::ProcessGroupNCCL::watchdogHandler() + 0x890 (0x{base + 0x41d7d0:x} in {_TORCH_LIB}/{lib})",
        f"frame #3: c10d::ProcessGroupNCCL::ncclCommWatchdog() + 0x14d (0x{base + 0x41eedd:x} in {_TORCH_LIB}/{lib})",
        f"frame #4: <unknown function> + 0xecdb4 (0x{base + 0x4ecdb4:x} in /usr/lib/x86_64-linux-gnu/libstdc++.so.6)",
        f"frame #5: <unknown function> + 0x9caa4 (0x{base + 0x9caa4:x} in /usr/lib/x86_64-linux-gnu/libc.so.6)",
        f"frame #6: <unknown function> + 0x129c3c (0x{base + 0x129c3c:x} in /usr/lib/x86_64-linux-gnu/libc.so.6)",
    ]


def watchdog(worker: Worker, clock: SimClock, rng: random.Random, seq: int, timeout_ms: int,
             lagging: int | None, world: int) -> tuple[list[list[str]], list[str]]:
    """One rank's watchdog timeout: its c10 ERROR messages (each a list of physical lines, the
    first with the desync report when `lagging` is given), and the native abort block."""
    r = worker.rank
    ran = timeout_ms + rng.randrange(3, 95)
    work = (f"WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn=26214400, NumelOut=26214400, "
            f"Timeout(ms)={timeout_ms})")
    caught = f"[Rank {r}] Watchdog caught collective operation timeout: {work} ran for {ran} milliseconds before timing out."
    pg = f"[PG ID 0 PG GUID 0(default_pg) Rank {r}]"

    def err(where: str, message: str) -> str:
        return f"{worker.cpp}{clock.cpp_glog('E', rng.getrandbits(27))} {where}] {message}"

    first = [err("ProcessGroupNCCL.cpp:632", caught)]
    if lagging is not None:  # TORCH_NCCL_DESYNC_DEBUG=1 appends a report; its lines are bare
        others = ", ".join(str(k) for k in range(world) if k != lagging)
        first += [worker.out + line for line in (
            f"\t - [{r}] Timeout at collective: ALLREDUCE, #{seq}",
            "\t - To our best knowledge, the lagging/dead/mismatched ranks that caused the desync are:",
            f"\t   - [{lagging}] finished collective #{seq - 1}, but didn't join collective #{seq} (count from 1)",
            "\t - Snapshot of ranks' latest states:",
            f"\t   #{seq} started ranks:",
            f"\t     [{others}] started ALLREDUCE",
        )]
    glog = [first] + [[line] for line in (
        err("ProcessGroupNCCL.cpp:2271", f"{pg}  failure detected by watchdog at work sequence id: {seq} "
            f"PG status: last enqueued work: {seq + 1}, last completed work: {seq - 1}"),
        err("ProcessGroupNCCL.cpp:670", "Stack trace of the failed collective not found, potentially because "
            "FlightRecorder is disabled. You can enable it by setting TORCH_NCCL_TRACE_BUFFER_SIZE to a non-zero value."),
        err("ProcessGroupNCCL.cpp:684", f"[Rank {r}] Some NCCL operations have failed or timed out. Due to the "
            "asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data."),
        err("ProcessGroupNCCL.cpp:698", f"[Rank {r}] To avoid data inconsistency, we are taking the entire process down."),
        err("ProcessGroupNCCL.cpp:1899", f"{pg} Process group watchdog thread terminated with exception: {caught}"),
    )]
    raised = ("Exception raised from checkTimeout at /opt/pytorch/pytorch/torch/csrc/distributed/c10d/"
              "ProcessGroupNCCL.cpp:635 (most recent call first):")
    frames = _frames(rng, "libtorch_cuda.so")
    native = [raised, *frames, "",
              "terminate called after throwing an instance of 'c10::DistBackendError'",
              f"  what():  {pg} Process group watchdog thread terminated with exception: {caught}",
              raised, *frames, "",
              "Exception raised from ncclCommWatchdog at /opt/pytorch/pytorch/torch/csrc/distributed/c10d/"
              "ProcessGroupNCCL.cpp:1905 (most recent call first):",
              *frames[:1], *frames[4:], ""]
    return glog, [worker.out + line for line in native]


def _entry(idx: int, rec: ExitRecord) -> list[str]:
    wk = rec.worker
    if rec.exitcode < 0:
        sig = SIGNALS[rec.exitcode]
        code = f"{rec.exitcode} (pid: {wk.pid})  ({sig})"
        trace = f"Signal {-rec.exitcode} ({sig}) received by PID {wk.pid}"
    else:
        code = f"{rec.exitcode} (pid: {wk.pid}) "
        trace = f"To enable traceback see: {_ERRORS_URL}"
    return [f"[{idx}]:", f"  time      : {rec.time}", f"  host      : {wk.host}",
            f"  rank      : {wk.rank} (local_rank: {wk.local})", f"  exitcode  : {code}",
            "  error_file: <N/A>", f"  traceback : {trace}"]


def child_failed_block(records: list[ExitRecord]) -> list[str]:
    """The launcher's traceback and the ChildFailedError text; records[0] is the root cause."""
    title = f"{ENTRYPOINT} FAILED"
    entries = [_entry(i, rec) for i, rec in enumerate(records)]
    width = min(60, max([len(title)] + [len(line) for entry in entries for line in entry]))
    failures = [line for entry in entries[1:] for line in entry] or ["  <NO_OTHER_FAILURES>"]
    return [
        "Traceback (most recent call last):",
        '  File "/usr/local/bin/torchrun", line 8, in <module>',
        "    sys.exit(main())",
        "             ^^^^^^",
        f'  File "{SITE}/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 355, in wrapper',
        "    return f(*args, **kwargs)",
        "           ^^^^^^^^^^^^^^^^^^",
        f'  File "{SITE}/torch/distributed/run.py", line 918, in main',
        "    run(args)",
        f'  File "{SITE}/torch/distributed/run.py", line 909, in run',
        "    elastic_launch(",
        f'  File "{SITE}/torch/distributed/launcher/api.py", line 138, in __call__',
        "    return launch_agent(self._config, self._entrypoint, list(args))",
        "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
        f'  File "{SITE}/torch/distributed/launcher/api.py", line 269, in launch_agent',
        "    raise ChildFailedError(",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "=" * width, title, "-" * width, "Failures:", *failures, "-" * width,
        "Root Cause (first observed failure):", *entries[0], "=" * width,
    ]


def agent_failure(agent: Agent, clock: SimClock, records: list[ExitRecord]) -> tuple[list[str], int]:
    """The agent stops the rest of its workers, reports the first failure and raises.

    Returns the lines and the index of the `failed (exitcode: ...)` line.
    """
    api = "torch/distributed/elastic/multiprocessing/api.py"
    lines = [agent_line(clock, agent, "W", f"{api}:897", f"Sending process {rec.worker.pid} closing signal SIGTERM")
             for rec in records[1:] if rec.exitcode == -15]
    root = records[0]
    clock.advance(1_000_000)
    failed_at = len(lines)
    lines.append(agent_line(clock, agent, "E", f"{api}:869", f"failed (exitcode: {root.exitcode}) local_rank: "
                            f"{root.worker.local} (pid: {root.worker.pid}) of binary: {BINARY}"))
    lines += [agent.out + line for line in child_failed_block(records)]
    return lines, failed_at


def srun_exit(agent: Agent, task: int) -> str:
    return f"srun: error: {agent.host}: task {task}: Exited with exit code 1"
