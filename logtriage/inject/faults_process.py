"""Process-level faults on CPU/gloo: exceptions, signals, exit codes, stuck ranks, restarts.

Conventions for the expected diagnosis (see docs/inject.md):
the root-cause rank is the injected rank when the log can show it; the same error on every rank
names the lowest rank and lists them all; a skipped collective names the rank that skipped;
launcher-level errors name no rank; a silent NaN run exits 0 but is still ``failed``.
"""

from __future__ import annotations

from dataclasses import replace

from logtriage.inject.model import (Backend, Expectation, RankRef, RankSet, Scenario, Variant,
                                    Verdict)
from logtriage.inject.noise import RANK_EXCEPTION_NOISE

FAILED = Verdict.FAILED
BOTH = (Backend.GLOO, Backend.NCCL)


def _env(**values: str) -> tuple[tuple[str, str], ...]:
    return tuple(values.items())


def _same_on_all(category: str, rule: str, exception_type: str, note: str) -> Expectation:
    return Expectation(FAILED, category, rule, RankRef.LOWEST, RankSet.ALL,
                       exception_type=exception_type, note=note)


CLOSED = ("gloo.connection_closed",)

KEY_ERROR = Expectation(
    FAILED, "python_exception", "python.exception", RankRef.FAULT, exception_type="KeyError",
    required_findings=CLOSED,
    note="rank {fault} raises KeyError mid-step; the other ranks die of gloo peer errors "
         "in the gradient all-reduce and the agent's SIGTERM")

HEALTHY = Scenario(
    name="healthy", fault_on_rank=False, script="healthy.py", backends=BOTH, exit_code=0,
    description="the control: a clean DDP run that saves a checkpoint the DDP way",
    expect=Expectation(Verdict.OK, note="clean run; every rank prints its steps"),
    evidence="training finished",
    variants=(
        Variant("np2"), Variant("np4", nproc=4),
        Variant("standalone", master_port=False, launcher_args=("--standalone",)),
        Variant("tee3", launcher_args=("--tee", "3")),
        Variant("loglevel_info", env=_env(LOGLEVEL="INFO")),
        Variant("probe", script_args=("--probe",), evidence="LOGTRIAGE_ENVIRONMENT_JSON="),
    ),
)

RANK_EXCEPTION = Scenario(
    name="rank_exception", script="rank_exception.py", backends=BOTH,
    description="one rank raises KeyError mid-step while the others wait in the all-reduce",
    expect=KEY_ERROR, evidence="KeyError: 'target'",
    variants=(
        Variant("np2"),
        Variant("np3", nproc=3, fault_rank=2),
        Variant("np4", nproc=4, fault_rank=2),
        Variant("np4_record", nproc=4, fault_rank=3, script_args=("--record",)),
        Variant("np2_linger", script_args=("--linger",),
                expect=replace(KEY_ERROR, required_findings=("gloo.timeout",),
                               note="rank {fault} raises KeyError but a non-daemon thread keeps "
                                    "it alive; rank 0 times out in the all-reduce")),
        *RANK_EXCEPTION_NOISE,
    ),
)

ALL_RANKS_NAMEERROR = Scenario(
    name="all_ranks_nameerror", fault_on_rank=False, script="all_ranks_nameerror.py",
    description="every rank raises the same NameError at the same step",
    expect=_same_on_all("python_exception", "python.exception", "NameError",
                        "identical NameError (scheduler never defined) on every rank"),
    evidence="NameError: name 'scheduler' is not defined",
    variants=(Variant("np2"), Variant("np4", nproc=4),
              Variant("np4_record", nproc=4, script_args=("--record",))),
)

RANK_SIGKILL = Scenario(
    name="rank_sigkill", script="rank_dies.py", script_args=("--how", "kill"),
    description="one rank is killed with SIGKILL (as the kernel OOM killer does)",
    expect=Expectation(FAILED, "crash_signal", "signal.sigkill", RankRef.FAULT,
                       note="rank {fault} gets SIGKILL mid-run and prints nothing; its peers "
                            "see 'Connection reset by peer' (or, in some runs, 'closed')"),
    evidence="(SIGKILL)",
    variants=(Variant("np2"), Variant("np4", nproc=4, fault_rank=3)),
)

RANK_SIGTERM = Scenario(
    name="rank_sigterm", script="rank_dies.py", script_args=("--how", "term"),
    description="one rank gets a SIGTERM that torchrun did not send (a supervisor, a per-process limit)",
    expect=Expectation(FAILED, "crash_signal", "signal.sigterm_unsent", RankRef.FAULT,
                       note="rank {fault} dies of SIGTERM before the teardown; torchrun's 'Sending process "
                            "N closing signal SIGTERM' lines name the other ranks' pids, not its own"),
    evidence="(exitcode: -15)",
    variants=(Variant("np2"), Variant("np4", nproc=4, fault_rank=2)),
)

RANK_SIGSEGV = Scenario(
    name="rank_sigsegv", script="rank_dies.py", script_args=("--how", "segv"),
    description="one rank segfaults (a real NULL-pointer read through ctypes)",
    expect=Expectation(FAILED, "crash_signal", "signal.sigsegv", RankRef.FAULT,
                       note="rank {fault} dies of SIGSEGV; exitcode -11 in the launcher block"),
    evidence="(SIGSEGV)",
    variants=(
        Variant("np2"),
        Variant("np2_faulthandler", env=_env(PYTHONFAULTHANDLER="1"),
                evidence="Fatal Python error: Segmentation fault"),
        Variant("np3", nproc=3, fault_rank=2),
    ),
)

RANK_EXIT_CODE = Scenario(
    name="rank_exit_code", script="rank_dies.py", script_args=("--how", "exit3"),
    description="one rank calls sys.exit(3): no traceback anywhere, only an exit code",
    expect=Expectation(FAILED, "unknown", "signal.exit_nonzero", RankRef.FAULT,
                       required_findings=CLOSED,
                       note="rank {fault} exits with code 3 and no message"),
    evidence="exitcode  : 3",
    variants=(Variant("np2"),),
)

WATCHDOG_STUCK_RANK = Scenario(
    name="watchdog_stuck_rank", script="watchdog_stuck_rank.py",
    description="a heartbeat watchdog (DDPWatchdog) ends a rank stuck on a lock, before the "
                "process-group timeout",
    expect=Expectation(FAILED, "hang", "hang.watchdog_heartbeat", RankRef.FAULT,
                       required_findings=CLOSED,
                       note="rank {fault} blocks on a lock after its all-reduce; its watchdog "
                            "prints [FATAL] after 4 s without a step and calls os._exit(1); "
                            "the others see 'Connection closed by peer'"),
    evidence="秒无 Step 心跳",
    variants=(Variant("np2"), Variant("np3", nproc=3, fault_rank=2)),
)

LOADER_WORKER_CRASH = Scenario(
    name="loader_worker_crash", script="loader_worker_crash.py", fault_rank=1,
    script_args=("--fault-step", "5"),
    description="a DataLoader worker process of one rank dies (SIGKILL or SIGSEGV)",
    expect=Expectation(FAILED, "crash_signal", "data.loader_worker_died", RankRef.FAULT,
                       exception_type="RuntimeError", required_findings=CLOSED,
                       note="rank {fault}'s loader worker dies while prefetching; the rank "
                            "raises 'DataLoader worker (pid N) is killed by signal'"),
    evidence="DataLoader worker (pid ",
    variants=(
        Variant("sigkill_np2", script_args=("--how", "kill")),
        Variant("sigsegv_np3", nproc=3, fault_rank=2, script_args=("--how", "segv")),
    ),
)

MAX_RESTARTS = Scenario(
    name="max_restarts", script="rank_exception.py", timeout_s=300.0,
    description="restarts with --max-restarts: the first attempt's KeyError is the root cause, "
                "whatever later attempts die of",
    expect=replace(KEY_ERROR, note="attempt 0: rank {fault} raises KeyError; the restarted "
                   "attempt fails again (KeyError, or gloo connectFullMesh on torch 2.13 CPU)"),
    evidence="KeyError: 'target'",
    variants=(
        Variant("always_fail_max1", launcher_args=("--max-restarts", "1")),
        Variant("always_fail_max1_loglevel_info", launcher_args=("--max-restarts", "1"),
                env=_env(LOGLEVEL="INFO")),
    ),
)

FD_EXHAUSTED = Scenario(
    name="fd_exhausted", script="resource_exhausted.py", script_args=("--how", "fds"),
    description="one rank runs out of file descriptors (a dataset that never closes its files)",
    expect=Expectation(FAILED, "environment", "host.too_many_open_files", RankRef.FAULT,
                       exception_type="OSError", required_findings=CLOSED,
                       note="rank {fault} lowers RLIMIT_NOFILE and opens files until EMFILE; "
                            "its peers see 'Connection closed by peer'"),
    evidence="Too many open files",
    variants=(Variant("np2"), Variant("np3", nproc=3, fault_rank=2)),
)

NO_INIT = Scenario(
    name="no_init", script="resource_exhausted.py", script_args=("--how", "no_init"),
    description="one rank never calls init_process_group and asks torch.distributed for its rank",
    expect=Expectation(FAILED, "launch_usage", "dist.pg_not_initialized", RankRef.FAULT,
                       exception_type="ValueError",
                       note="rank {fault} raises 'Default process group has not been initialized'; "
                            "the others wait in init_process_group until the agent stops them"),
    evidence="Default process group has not been initialized",
    variants=(Variant("np2"),),
)

SCENARIOS = (HEALTHY, RANK_EXCEPTION, ALL_RANKS_NAMEERROR, RANK_SIGKILL, RANK_SIGTERM, RANK_SIGSEGV,
             RANK_EXIT_CODE, WATCHDOG_STUCK_RANK, LOADER_WORKER_CRASH, MAX_RESTARTS, FD_EXHAUSTED, NO_INIT)
