"""Launchers that start several processes and label each output line with where it came from:
Slurm's `srun --label` (`3: `, the task id right-aligned to the width of the largest id) and
pdsh, which DeepSpeed's multi-node runner uses (`worker-1: `).

Neither Slurm nor pdsh runs on a single machine without a cluster, so the runner starts the same
processes they would start (a torchrun agent per node, or one Python process per task with
Slurm's SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID), reads each one's output line by line and writes
it to the log with the launcher's label, in the order the lines arrive. What is emulated is only
the labelling; the launchers' own failure notices (`srun: error: node: task 3: Exited with exit
code 1`, `pdsh@host: worker-1: ssh exited with exit code 1`) are not written, so a captured log
holds less than a real one would. The exit code is the largest of the processes' codes, as srun
reports it (and pdsh with -S).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO


@dataclass(frozen=True)
class Task:
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    label: bytes                 # written in front of every line of this task's output


def srun_label(task: int, ntasks: int) -> bytes:
    """Slurm's `--label` prefix: `%*d: ` with the width of the largest task id."""
    return f"{task:>{len(str(ntasks - 1))}}: ".encode()


def pdsh_label(host: str) -> bytes:
    return f"{host}: ".encode()


def run_tasks(tasks: list[Task], cwd: Path, base_env: dict[str, str], log: BinaryIO,
              timeout_s: float) -> tuple[int, bool]:
    """Run every task at once and copy their labelled lines into ``log``; returns the largest
    exit code and whether the safety timeout had to stop them."""
    lock = threading.Lock()
    procs = [subprocess.Popen(list(t.argv), cwd=cwd, env={**base_env, **dict(t.env)}, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
             for t in tasks]
    readers = [threading.Thread(target=_copy, args=(p.stdout, t.label, log, lock), daemon=True)
               for p, t in zip(procs, tasks)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout_s
    timed_out = False
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    for proc in procs:
        stop_group(proc)
    for reader in readers:
        reader.join(timeout=10)
    codes = [p.wait() for p in procs]
    return max(codes, key=_severity), timed_out


def _copy(stream: BinaryIO, label: bytes, log: BinaryIO, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            log.write(label + line)
            log.flush()
    stream.close()


def _severity(code: int) -> int:
    """srun's choice among the tasks' codes: any failure over success, a signal's 128+N like a shell."""
    return 128 - code if code < 0 else code


def stop_group(proc: subprocess.Popen) -> None:
    """Stop a process started in its own session and whatever it left running there (workers that
    outlive their agent): SIGTERM, then SIGKILL after 5 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue
