"""Noise variants of the one-rank-exception scenario: the same fault, other console shapes.

Launcher flags (tee, role, local-ranks filter, log dir), the prefix template, log levels,
timestamped logging, progress bars, the environment probe line and other launchers (mpirun
--tag-output when Open MPI is installed). Only the
local-ranks filter changes what the log can show: the culprit's traceback is hidden, so the
diagnosis can only be "rank N exited with 1" (from the ChildFailedError block); with --tee, the
lines shown all carry rank 0's label, so rank N's output went elsewhere and its exit code 1 is read
as an uncaught exception.
"""

from __future__ import annotations

from logtriage.inject.model import Expectation, Launcher, RankRef, Variant, Verdict

TEE = ("--tee", "3")
PREFIX_TEMPLATE = (("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
                    "[${role_name}|rank=${rank}|local=${local_rank}] "),)

HIDDEN_TRACEBACK = Expectation(
    Verdict.FAILED, "unknown", "signal.exit_nonzero", RankRef.FAULT,
    note="--local-ranks-filter 0 hides rank {fault}'s KeyError; only rank 0's gloo error and the "
         "ChildFailedError naming rank {fault} (exitcode 1) remain")
# with --tee every line shown carries its rank's label: none is rank {fault}'s, so its output went elsewhere, and
# its exit code 1 is the interpreter's on an uncaught exception
FILTERED_TRACEBACK = Expectation(
    Verdict.FAILED, "python_exception", "python.exit_one_output_elsewhere", RankRef.FAULT,
    note="--local-ranks-filter 0 with --tee 3 hides rank {fault}'s KeyError; rank 0's lines are labelled, none is "
         "rank {fault}'s, and the ChildFailedError names rank {fault} (exitcode 1)")

RANK_EXCEPTION_NOISE = (
    Variant("tee3", launcher_args=TEE),
    Variant("tee2_stderr_only", launcher_args=("--tee", "2")),
    Variant("tee3_role_trainer", launcher_args=(*TEE, "--role", "trainer")),
    Variant("local_ranks_filter0", launcher_args=("--local-ranks-filter", "0"),
            expect=HIDDEN_TRACEBACK, evidence="Root Cause (first observed failure)"),
    Variant("tee3_local_ranks_filter0", launcher_args=(*TEE, "--local-ranks-filter", "0"),
            expect=FILTERED_TRACEBACK, evidence="Root Cause (first observed failure)"),
    Variant("prefix_template_tee3", launcher_args=TEE, env=PREFIX_TEMPLATE,
            evidence="|rank=1|local=1] "),
    Variant("loglevel_info", env=(("LOGLEVEL", "INFO"),)),
    Variant("cpp_log_info", env=(("TORCH_CPP_LOG_LEVEL", "INFO"),
                                 ("TORCH_DISTRIBUTED_DEBUG", "INFO"))),
    Variant("logging_format", script_args=("--log-format",)),
    Variant("cpp_stacktraces", env=(("TORCH_SHOW_CPP_STACKTRACES", "1"),)),   # C++ frames under c10 errors
    Variant("tqdm", script_args=("--tqdm",), requires_modules=("tqdm",)),
    Variant("probe", script_args=("--probe",)),
    Variant("tee3_logdir_record", launcher_args=TEE, script_args=("--record",), log_dir=True),
    Variant("all_noise_tee3", nproc=3, fault_rank=2, launcher_args=TEE,
            env=(("LOGLEVEL", "INFO"), ("TORCH_CPP_LOG_LEVEL", "INFO")),
            script_args=("--log-format", "--probe", "--tqdm", "--record"),
            requires_modules=("tqdm",)),
    Variant("python_m_run", launcher=Launcher.RUN_MODULE),
    Variant("legacy_launch", launcher=Launcher.LAUNCH_MODULE),
    Variant("mpirun_tag_output", launcher=Launcher.MPIRUN, requires_programs=("mpirun",)),
    Variant("srun_label_tasks", nproc=4, fault_rank=2, launcher=Launcher.SRUN_TASKS),
    Variant("srun_label_nodes_tee3", nproc=4, fault_rank=3, launcher=Launcher.SRUN_NODES, launcher_args=TEE),
    Variant("pdsh_nodes_tee3", nproc=4, fault_rank=2, launcher=Launcher.PDSH_NODES, launcher_args=TEE),
    Variant("pdsh_nodes", nproc=4, fault_rank=1, launcher=Launcher.PDSH_NODES),
    Variant("mp_spawn", launcher=Launcher.MP_SPAWN, evidence="ProcessRaisedException",
            expect=Expectation(Verdict.FAILED, "python_exception", "python.exception",
                               RankRef.FAULT, exception_type="KeyError",
                               note="mp.spawn: the parent re-raises rank {fault}'s KeyError as "
                                    "ProcessRaisedException ('-- Process {fault} terminated "
                                    "with the following error:'); no [rankN]: prefixes")),
)
