"""Collective and launcher-coordination faults on CPU/gloo: skipped, mismatched or rank-0-only
collectives, DDP's unused-parameter check, and a master port that is already taken."""

from __future__ import annotations

from logtriage.inject.model import (Backend, CodeBug, Expectation, RankRef, Scenario, Variant,
                                    Verdict)

FAILED = Verdict.FAILED
DETAIL = (("TORCH_DISTRIBUTED_DEBUG", "DETAIL"),)


def _mismatch_detail(kind: str) -> str:
    return (f"rank {{fault}} runs a collective with another {kind}; under DETAIL every rank "
            "raises 'Detected mismatch between collectives' and the two agreeing ranks name "
            "rank {fault}")


SKIP_COLLECTIVE = Scenario(
    name="skip_collective", script="skip_collective.py",
    code_bugs=(CodeBug.COLLECTIVE_IN_RANK_BRANCH,), backends=(Backend.GLOO, Backend.NCCL),
    description="one rank skips the metric all_reduce and goes on with slow local work",
    expect=Expectation(FAILED, "collective_timeout", "gloo.timeout", RankRef.FAULT,
                       note="rank {fault} skipped the all_reduce; the other ranks time out after "
                            "10 s and rank {fault} is SIGTERMed without an error"),
    evidence="Timed out waiting 10000ms",
    variants=(Variant("np2"), Variant("np3", nproc=3, fault_rank=2)),
)

UNEVEN_BATCHES = Scenario(
    name="uneven_batches", script="uneven_batches.py",
    description="one rank's data shard is shorter: it reaches the final barrier while the others wait in backward",
    expect=Expectation(FAILED, "collective_timeout", "gloo.timeout", RankRef.FAULT,
                       note="rank {fault} ran out of batches and waits in barrier(); the others wait in "
                            "DDP's gradient all-reduce; every rank times out after 10 s"),
    evidence="Timed out waiting 10000ms",
    variants=(Variant("np3", nproc=3, fault_rank=2), Variant("np4", nproc=4, fault_rank=1)),
)

COLLECTIVE_MISMATCH = Scenario(
    name="collective_mismatch", script="collective_mismatch.py",
    code_bugs=(CodeBug.COLLECTIVE_IN_RANK_BRANCH,),
    description="one rank runs another collective (op, shape or dtype) than its peers",
    expect=Expectation(FAILED, "collective_mismatch", "dist.collective_mismatch", RankRef.FAULT,
                       exception_type="RuntimeError", note=_mismatch_detail("op")),
    evidence="Detected mismatch between collectives on ranks",
    variants=(
        Variant("op_detail_np3", nproc=3, fault_rank=2, env=DETAIL,
                script_args=("--kind", "op")),
        Variant("shape_detail_np3", nproc=3, fault_rank=2, env=DETAIL,
                script_args=("--kind", "shape"),
                expect=Expectation(FAILED, "collective_mismatch", "dist.collective_mismatch",
                                   RankRef.FAULT, exception_type="RuntimeError",
                                   note=_mismatch_detail("shape"))),
        Variant("dtype_detail_np3", nproc=3, fault_rank=1, env=DETAIL,
                script_args=("--kind", "dtype"),
                expect=Expectation(FAILED, "collective_mismatch", "dist.collective_mismatch",
                                   RankRef.FAULT, exception_type="RuntimeError",
                                   note=_mismatch_detail("dtype"))),
        Variant("op_detail_cpp_info_np3", nproc=3, fault_rank=2,
                env=(*DETAIL, ("TORCH_CPP_LOG_LEVEL", "INFO")), script_args=("--kind", "op")),
        Variant("op_nodebug_np2", script_args=("--kind", "op"),
                evidence="Timed out waiting 10000ms",
                expect=Expectation(FAILED, "collective_timeout", "gloo.timeout",
                                   note="rank {fault} broadcasts while rank 0 all_reduces; "
                                        "without DETAIL both hang until the 10 s timeout and "
                                        "the log cannot tell which rank diverged")),
        Variant("shape_nodebug_np2", script_args=("--kind", "shape"),
                evidence="Received data size doesn't match expected size",
                expect=Expectation(FAILED, "collective_mismatch", "gloo.size_mismatch",
                                   note="all_reduce of 5 vs 4 floats: a receiving rank aborts "
                                        "in gloo::EnforceNotMet (SIGABRT); with two ranks the "
                                        "log cannot tell which one diverged")),
        Variant("dtype_nodebug_np2", script_args=("--kind", "dtype"),
                evidence="Received data size doesn't match expected size",
                expect=Expectation(FAILED, "collective_mismatch", "gloo.size_mismatch",
                                   note="all_reduce of float64 vs float32: gloo sees a size "
                                        "mismatch and aborts (SIGABRT); no rank can be named")),
    ),
)

RANK0_COLLECTIVE = Scenario(
    name="rank0_collective", script="rank0_collective.py", fault_rank=0, fault_on_rank=False,
    code_bugs=(CodeBug.COLLECTIVE_IN_RANK_BRANCH,),
    description="a rank-0-only branch calls all_reduce; the other ranks never join it",
    expect=Expectation(FAILED, "collective_error", "gloo.connection_closed", RankRef.LOWEST,
                       note="rank 0 all_reduces a validation metric alone; the others finish "
                            "and exit 0, so rank 0 fails with 'Connection closed by peer' and "
                            "is the only failure (<NO_OTHER_FAILURES>)"),
    evidence="Connection closed by peer",
    variants=(
        Variant("others_exit_np2", script_args=("--others", "exit")),
        Variant("others_barrier_np3", nproc=3, script_args=("--others", "barrier"),
                evidence="Timed out waiting 10000ms",
                expect=Expectation(FAILED, "collective_timeout", "gloo.timeout", RankRef.LOWEST,
                                   note="rank 0 waits in its all_reduce, the others in the "
                                        "closing barrier; all time out after 10 s")),
    ),
)

DDP_UNUSED_PARAMS = Scenario(
    name="ddp_unused_params", script="ddp_unused_params.py",
    description="a parameter gets no gradient on one rank (find_unused_parameters=False)",
    expect=Expectation(FAILED, "ddp_usage", "ddp.unused_parameters", RankRef.FAULT,
                       exception_type="RuntimeError",
                       required_findings=("gloo.connection_closed",),
                       note="rank {fault} skips the auxiliary head; DDP raises 'Expected to have "
                            "finished reduction in the prior iteration' at its next step"),
    evidence="Expected to have finished reduction in the prior iteration",
    variants=(
        Variant("default_np2"),
        Variant("debug_info_np3", nproc=3, fault_rank=2,
                env=(("TORCH_DISTRIBUTED_DEBUG", "INFO"),),
                evidence="Parameters which did not receive grad for rank"),   # any fault rank a matrix draws
    ),
)

PORT_IN_USE = Scenario(
    name="port_in_use", fault_on_rank=False, script="healthy.py",
    description="the master port is held by another process (a stale job)",
    expect=Expectation(FAILED, "rendezvous", "dist.port_in_use",
                       exception_type="torch.distributed.DistNetworkError",
                       note="torchrun cannot bind --master-port (EADDRINUSE); no worker starts "
                            "and there is no ChildFailedError"),
    evidence="EADDRINUSE",
    variants=(Variant("static_master_port", occupy_master_port=True),),
)

SCENARIOS = (SKIP_COLLECTIVE, UNEVEN_BATCHES, COLLECTIVE_MISMATCH, RANK0_COLLECTIVE, DDP_UNUSED_PARAMS,
             PORT_IN_USE)
