"""GPU/NCCL fault scenarios: declared everywhere, runnable only where CUDA is present.

The runner skips them with a reason on CPU-only machines (and when fewer GPUs are visible than
a variant needs). Their expectations come from the message templates in FORMATS.md §11 and
public logs, not from a run on this project's CPU machine.
"""

from __future__ import annotations

from logtriage.inject.model import (Backend, CodeBug, Expectation, RankRef, RankSet, Scenario,
                                    Variant, Verdict)

FAILED = Verdict.FAILED
NCCL = (Backend.NCCL,)


def _gpu(name: str, description: str, expect: Expectation, evidence: str,
         variants: tuple[Variant, ...], script: str = "gpu_faults.py",
         script_args: tuple[str, ...] = (), min_gpus: int = 0, exit_code: int = 1,
         code_bugs: tuple[CodeBug, ...] = ()) -> Scenario:
    return Scenario(name=name, script=script, description=description, expect=expect,
                    evidence=evidence, variants=variants, script_args=script_args,
                    backends=NCCL, requires_cuda=True, min_gpus=min_gpus, exit_code=exit_code,
                    code_bugs=code_bugs)


CUDA_OOM = _gpu(
    "cuda_oom", "one rank asks the caching allocator for twice its GPU's memory",
    Expectation(FAILED, "gpu_oom", "cuda.oom", RankRef.FAULT,
                exception_type="torch.OutOfMemoryError",
                note="rank {fault}: CUDA out of memory. Tried to allocate ..."),
    "CUDA out of memory", script_args=("--fault", "oom"),
    variants=(Variant("np1", nproc=1, fault_rank=0), Variant("np2")),
)

DEVICE_SIDE_ASSERT = _gpu(
    "device_side_assert", "one rank indexes an embedding past its end on the GPU",
    Expectation(FAILED, "cuda_runtime", "cuda.device_side_assert", RankRef.FAULT,
                exception_type="torch.AcceleratorError",
                note="rank {fault}: device-side assert triggered (index out of bounds)"),
    "device-side assert triggered", script_args=("--fault", "device_assert"),
    variants=(Variant("np1", nproc=1, fault_rank=0), Variant("np2")),
)

INVALID_DEVICE_ORDINAL = _gpu(
    "invalid_device_ordinal", "one rank selects a device index past the visible GPUs",
    Expectation(FAILED, "device_assignment", "cuda.invalid_device_ordinal", RankRef.FAULT,
                exception_type="torch.AcceleratorError",
                note="rank {fault}: CUDA error: invalid device ordinal, before the process group"),
    "invalid device ordinal", script_args=("--fault", "invalid_ordinal"), min_gpus=1,
    variants=(Variant("np2"),),
)

DUPLICATE_GPU = _gpu(
    "duplicate_gpu", "two ranks select the same GPU, so NCCL refuses the communicator",
    Expectation(FAILED, "device_assignment", "nccl.duplicate_gpu", RankRef.LOWEST, RankSet.ALL,
                exception_type="torch.distributed.DistBackendError",
                note="every rank calls set_device(0): NCCL invalid usage, Duplicate GPU detected"),
    "Duplicate GPU detected", script_args=("--fault", "duplicate_gpu"), min_gpus=1,
    variants=(Variant("np2"),),
)

NCCL_WATCHDOG_TIMEOUT = _gpu(
    "nccl_watchdog_timeout",
    "one rank skips an all_reduce under NCCL; the watchdog times out and dumps the flight recorder",
    Expectation(FAILED, "collective_timeout", "nccl.watchdog_timeout", RankRef.FAULT,
                note="rank {fault} skipped the all_reduce; the other rank's NCCL watchdog "
                     "times out after 10 s, dumps the flight recorder and aborts"),
    "Watchdog caught collective operation timeout", script="skip_collective.py", min_gpus=2,
    code_bugs=(CodeBug.COLLECTIVE_IN_RANK_BRANCH,),
    variants=(Variant("flight_recorder_np2", env=(
        ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"), ("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"),
        ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "run/nccl_trace_rank_"),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"))),),
)

AMP_NAN = _gpu(
    "amp_nan", "a NaN on one rank under bf16/fp16 autocast (fp16 with a GradScaler)",
    Expectation(FAILED, "numerical", "numerical.loss_nan", RankRef.FAULT,
                note="rank {fault}'s loss is nan from the fault step on; the GradScaler skips "
                     "steps and lowers its scale (fp16) or the weights go nan (bf16); exit 0"),
    "loss nan", script="amp_nan.py", exit_code=0,
    variants=(Variant("fp16_np1", nproc=1, fault_rank=0, script_args=("--precision", "fp16")),
              Variant("bf16_np1", nproc=1, fault_rank=0, script_args=("--precision", "bf16")),
              Variant("fp16_np2", script_args=("--precision", "fp16"))),
)

SCENARIOS = (CUDA_OOM, DEVICE_SIDE_ASSERT, INVALID_DEVICE_ORDINAL, DUPLICATE_GPU,
             NCCL_WATCHDOG_TIMEOUT, AMP_NAN)
