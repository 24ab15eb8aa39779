"""Faults in what the ranks compute or load on CPU/gloo: NaN/inf, host memory, checkpoints,
and code that asks for CUDA where there is none."""

from __future__ import annotations

from logtriage.inject.model import (CodeBug, Expectation, RankRef, RankSet, Scenario, Variant,
                                    Verdict)

FAILED = Verdict.FAILED


def _all_ranks(category: str, rule: str, exception_type: str, note: str) -> Expectation:
    return Expectation(FAILED, category, rule, RankRef.LOWEST, RankSet.ALL,
                       exception_type=exception_type, note=note)


def _before_init(rule: str, exception_type: str, what: str) -> Expectation:
    """Every rank fails before the process group exists: tracebacks carry no rank prefix, and
    the agent may SIGTERM a rank before it prints, so the log cannot name a rank reliably."""
    return Expectation(FAILED, "environment", rule, exception_type=exception_type,
                       note=f"{what} on every rank before the process group exists; the "
                            "tracebacks carry no rank prefix and the agent may stop a rank "
                            "before it prints")


NAN_INJECTION = Scenario(
    name="nan_injection", script="nan_injection.py",
    description="a NaN or inf enters one rank's batch; the gradient average spreads it",
    expect=Expectation(FAILED, "numerical", "numerical.loss_nan", RankRef.FAULT,
                       note="rank {fault}'s loss turns nan first (the others' loss is finite in "
                            "that step but their grad_norm is nan); every later loss is nan and "
                            "the launcher exits 0"),
    exit_code=0, evidence="loss nan grad_norm nan",
    variants=(
        Variant("loss_nan_np2", script_args=("--check", "none")),
        Variant("loss_nan_np3", nproc=3, fault_rank=2, script_args=("--check", "none")),
        Variant("detect_anomaly_np2", script_args=("--check", "anomaly"), exit_code=1,
                evidence="returned nan values in its 0th output",
                expect=Expectation(FAILED, "numerical", "numerical.anomaly_nan", RankRef.FAULT,
                                   exception_type="RuntimeError",
                                   note="detect_anomaly makes rank {fault}'s backward raise "
                                        "'Function MseLossBackward0 returned nan values'")),
        Variant("clip_nonfinite_inf_np3", nproc=3, fault_rank=2, exit_code=1,
                script_args=("--check", "clip", "--value", "inf"),
                evidence="is non-finite, so it cannot be clipped",
                expect=_all_ranks("numerical", "numerical.clip_nonfinite", "RuntimeError",
                                  "inf injected on rank {fault}; after the all-reduce every "
                                  "rank's clip_grad_norm_(error_if_nonfinite=True) raises, so "
                                  "the log cannot show where it entered")),
    ),
)

HOST_OOM = Scenario(
    name="host_oom", script="host_oom.py",
    description="one rank exhausts host memory under an RLIMIT_AS cap",
    expect=Expectation(FAILED, "host_oom", "host.cpu_alloc", RankRef.FAULT,
                       exception_type="RuntimeError",
                       required_findings=("gloo.connection_closed",),
                       note="rank {fault} asks torch's CPU allocator for 8 GiB above its cap"),
    evidence="DefaultCPUAllocator: can't allocate memory",
    variants=(
        Variant("torch_alloc_np2", script_args=("--alloc", "torch")),
        Variant("python_memoryerror_np3", nproc=3, fault_rank=2,
                script_args=("--alloc", "python"), evidence="MemoryError",
                expect=Expectation(FAILED, "host_oom", "host.memory_error", RankRef.FAULT,
                                   exception_type="MemoryError",
                                   note="rank {fault} builds an 8 GiB bytearray above its cap: "
                                        "a bare MemoryError")),
    ),
)

CKPT_LOAD = Scenario(
    name="ckpt_load", fault_on_rank=False, script="ckpt_load.py",
    description="resuming from a checkpoint that does not fit the model; every rank fails",
    expect=_all_ranks("checkpoint", "ckpt.missing_keys", "RuntimeError",
                      "the checkpoint has DDP's 'module.' prefixes; every rank's "
                      "load_state_dict reports missing and unexpected keys"),
    evidence="Error(s) in loading state_dict for Sequential",
    variants=(
        Variant("missing_keys_np2", script_args=("--defect", "missing_keys")),
        Variant("size_mismatch_np2", script_args=("--defect", "size_mismatch"),
                evidence="size mismatch for 0.weight",
                expect=_all_ranks("checkpoint", "ckpt.size_mismatch", "RuntimeError",
                                  "the model's hidden layer is 64 wide, the checkpoint's 32")),
        Variant("weights_only_np2", script_args=("--defect", "weights_only"),
                evidence="Weights only load failed",
                expect=_all_ranks("checkpoint", "ckpt.weights_only", "_pickle.UnpicklingError",
                                  "the checkpoint holds an argparse.Namespace, which "
                                  "torch.load(weights_only=True) refuses")),
    ),
)

CKPT_NO_BARRIER = Scenario(
    name="ckpt_no_barrier", script="ckpt_no_barrier.py",
    code_bugs=(CodeBug.SAVE_WITHOUT_BARRIER,),
    description="one rank saves a checkpoint without a barrier; another rank loads it too early",
    expect=Expectation(FAILED, "checkpoint", "ckpt.not_found", RankRef.FAULT,
                       exception_type="FileNotFoundError",
                       # no required cascade: the writer may be SIGTERMed while it sleeps, before
                       # its gloo pair notices the reader's exit
                       note="rank {fault} opens the checkpoint before the writer has written it"),
    evidence="No such file or directory",
    variants=(
        Variant("not_found_np2", script_args=("--write", "normal")),
        Variant("partial_write_np3", nproc=3, fault_rank=2, script_args=("--write", "partial"),
                evidence="failed finding central directory",
                expect=Expectation(FAILED, "checkpoint", "ckpt.corrupt_archive", RankRef.FAULT,
                                   exception_type="RuntimeError",
                                   note="rank {fault} reads the checkpoint while rank 0 is "
                                        "halfway through writing it: a truncated zip archive")),
    ),
)

CUDA_ON_CPU = Scenario(
    name="cuda_on_cpu", fault_on_rank=False, script="cuda_on_cpu.py",
    description="code that asks for CUDA on a CPU-only torch; every rank fails the same way",
    expect=_all_ranks("environment", "cuda.not_compiled", "AssertionError",
                      "model.to('cuda') on a CPU-only build: Torch not compiled with CUDA"),
    evidence="Torch not compiled with CUDA enabled",
    variants=(
        Variant("to_cuda_np2", script_args=("--how", "to_cuda")),
        Variant("set_device_np2", script_args=("--how", "set_device"),
                evidence="has no attribute '_cuda_setDevice'",
                expect=_before_init("cuda.not_compiled", "AttributeError",
                                    "torch.cuda.set_device(local_rank) raises")),
        Variant("nccl_np2", script_args=("--how", "nccl"),
                evidence="Distributed package doesn't have NCCL built in",
                expect=_before_init("dist.nccl_not_built", "RuntimeError",
                                    "init_process_group(backend='nccl') raises")),
        Variant("ddp_device_ids_np2", script_args=("--how", "ddp_device_ids"),
                evidence="device_ids and output_device arguments only work with",
                expect=_all_ranks("device_assignment", "ddp.device_ids_cpu", "ValueError",
                                  "DDP(device_ids=[local_rank]) around a CPU model")),
        Variant("bad_device_np2", script_args=("--how", "bad_device"),
                evidence="device type at start of device string: gpu",
                expect=_all_ranks("device_assignment", "cuda.bad_device_string", "RuntimeError",
                                  "a config asks for device 'gpu'")),
    ),
)

SCENARIOS = (NAN_INJECTION, HOST_OOM, CKPT_LOAD, CKPT_NO_BARRIER, CUDA_ON_CPU)
