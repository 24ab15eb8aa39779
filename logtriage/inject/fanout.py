"""Launchers that start several processes and label each output line with where it came from:
Slurm's `srun --label` (`3: `, the task id right-aligned to the width of the largest id) and
pdsh, which DeepSpeed's multi-node runner uses (`worker-1: `).

Neither Slurm nor pdsh runs on a single machine without a cluster, so the runner starts the same
processes they would start (a torchrun agent per node, or one Python process per task with
Slurm's SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID), reads each one's output line by line and writes
it to the log with the launcher's label, in the order the lines arrive. What is emulated is only
the labelling and the launchers' own notices of a failed task, written unlabelled when the task's
output has ended, in the launchers' wording: srun's `srun: error: node01: task 3: Exited with exit
code 1` or `...: task 3: Segmentation fault` (the signal's `strsignal` name, as in the srun logs of
sample_logs/public47) and
pdsh's `pdsh@launcher: worker-1: ssh exited with exit code 1`. What neither writes here: srun's
grouping of tasks that end together (`tasks 0-2: Terminated`), and the step cancellation a
cluster's KillOnBadExit adds. Tasks the safety timeout stops get no notice. The exit code is the
largest of the processes' codes, as srun reports it (and pdsh with -S).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable


@dataclass(frozen=True)
class Task:
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    label: bytes                 # written in front of every line of this task's output
    notice: Callable[[int], bytes] | None = None   # the launcher's line when the task fails, from its exit code


def srun_notice(node: str, task: int) -> Callable[[int], bytes]:
    """srun's report of a task that failed: its exit code, or the signal that ended it."""
    def notice(code: int) -> bytes:
        # a signal's name as srun prints it is the C library's strsignal text ("Segmentation fault")
        status = (signal.strsignal(-code) or f"Signal {-code}") if code < 0 else f"Exited with exit code {code}"
        return f"srun: error: {node}: task {task}: {status}\n".encode()
    return notice


def pdsh_notice(launcher: str, host: str) -> Callable[[int], bytes]:
    """pdsh's report of a host whose remote command failed (ssh passes on the exit status)."""
    def notice(code: int) -> bytes:
        return f"pdsh@{launcher}: {host}: ssh exited with exit code {128 - code if code < 0 else code}\n".encode()
    return notice


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
    stopping = threading.Event()
    procs = [subprocess.Popen(list(t.argv), cwd=cwd, env={**base_env, **dict(t.env)}, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
             for t in tasks]
    readers = [threading.Thread(target=_copy, args=(p, t, log, lock, stopping), daemon=True)
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
            stopping.set()
            break
    for proc in procs:
        stop_group(proc)
    for reader in readers:
        reader.join(timeout=10)
    codes = [p.wait() for p in procs]
    return max(codes, key=_severity), timed_out


def _copy(proc: subprocess.Popen, task: Task, log: BinaryIO, lock: threading.Lock,
          stopping: threading.Event) -> None:
    """Copy one task's lines with its label; when its output ends, the launcher's notice if it failed."""
    stream = proc.stdout
    for line in iter(stream.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            log.write(task.label + line)
            log.flush()
    stream.close()
    code = proc.wait()
    if task.notice is not None and code != 0 and not stopping.is_set():
        with lock:
            log.write(task.notice(code))
            log.flush()


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
