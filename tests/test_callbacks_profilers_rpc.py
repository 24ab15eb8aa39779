"""Trainer callbacks, profilers, and the batches after them, on real CPU runs of torch 2.13
(sample_logs/cpu_adhoc, the 78th batch on, each labelled before triage ran; the test names the run)."""

from __future__ import annotations

import pytest

from logtriage.analysis.early_stop import STOPPED_EARLY
from logtriage.api import triage

from sample_roots import SAMPLES


def _report(slug: str) -> dict:
    return triage([str(SAMPLES / f"{slug}.log")]).to_dict()


def test_a_rank_that_stopped_early_alone_left_its_one_peer_waiting():
    # two ranks: rank 1's EarlyStopping fires on its own metric, it prints `stopping at epoch 1` and `done` and
    # exits 0; rank 0 goes on into epoch 2's all-reduce and loses its peer
    rc = _report("cb_earlyexit_np2_r1_plain")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("gloo.connection_closed", "collective_error", 1)
    assert any("stopped early" in reason for reason in rc["reasons"])


def test_only_a_stop_the_rank_took_itself_reads_as_stopping_early():
    assert STOPPED_EARLY.search("rank 1: EarlyStopping: val_loss 1.3669 did not improve by 0.5, stopping at epoch 1")
    assert STOPPED_EARLY.search("early stop triggered at step 40")
    assert STOPPED_EARLY.search("rank 3 stopped early: budget spent")
    assert not STOPPED_EARLY.search("rank 1 done")
    assert not STOPPED_EARLY.search("stopping workers")
    assert not STOPPED_EARLY.search("Stopping worker group")


def test_the_profilers_caught_bad_alloc_before_a_native_crash_is_host_memory():
    # rank 1 profiles with profile_memory=True under RLIMIT_AS: RecordFunction callbacks log
    # `Exception in RecordFunction callback: std::bad_alloc` as [W] warnings, then the rank dies of SIGSEGV
    rc = _report("prof_profmem_np3_r1_plain")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("host.memory_error", "host_oom", 1, 1509)


def test_among_ranks_sharing_an_error_the_one_that_lost_no_peer_before_it_went_first():
    # rank 2's non-critical metrics callback fails (caught, logged) so it skips the all-reduce, and its critical
    # callback raises KeyError 'val_loss_global'; ranks 1 and 3 log a caught `Connection closed by peer` in the
    # all-reduce, then raise the same KeyError
    rc = _report("cb_caughtsync_np4_r2_plain")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"], rc["exception_type"]) == (
        "python.exception", "python_exception", 2, 39, "KeyError")


@pytest.mark.parametrize("slug, rank, exception_type", [
    # the caller's traceback (RuntimeError: KeyError: 'On WorkerInfo(id=2, ...') comes first and is torchrun's
    # Root Cause; worker 2 printed the KeyError itself under `On WorkerInfo(id=2, name=worker2):` and went on
    ("rpcs_keyerror_np4_r2_plain", 2, "KeyError"),
    ("rpcs_keyerror_np6_r5_tee3", 5, "KeyError"),
    # the caller aborts after re-raising (-6); the size mismatch was raised on worker 3
    ("rpcs_shape_np5_r3_plain", 3, "RuntimeError"),
    # a distributed backward: `RuntimeError: Error on Node 2: Function FeatureScaleBackward returned an invalid
    # gradient` on the caller, which then aborts
    ("rpcs_bwd_shape_np4_r2_plain", 2, "RuntimeError"),
])
def test_an_error_raised_in_a_remote_call_is_the_worker_that_ran_it(slug, rank, exception_type):
    rc = _report(slug)["root_cause"]
    assert (rc["category"], rc["rank"], rc["exception_type"]) == ("python_exception", rank, exception_type)
    assert any("torch.distributed.rpc on worker" in reason for reason in rc["reasons"])


def test_an_rpc_timeout_is_a_timeout_whose_callee_the_log_does_not_name():
    # rank 1's rpc_sync to worker 2 times out after 8 s (worker 2 stalls 40 s in a slow store); nothing names
    # worker 2, and the other ranks were in no collective with it
    report = _report("rpcs_slow_np4_r2_plain")
    rc = report["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("dist.rpc_timeout", "collective_timeout", None)


@pytest.mark.parametrize("slug", ["rpcs_worldsize_np4_r2_timeout", "hinit_world8_np4_rall_hang"])
def test_a_job_stopped_before_any_rank_printed_a_step_had_hung_in_its_start_up(slug):
    # `timeout 40 torchrun`: init never completes (a world size one too big on one rank / on every rank), every
    # rank printed only its start line; the launcher's stamps put the stop 36-38 s after the start
    report = _report(slug)
    rc = report["root_cause"]
    assert (report["verdict"], rc["rule_id"], rc["category"]) == ("hung", "hang.stopped_while_waiting", "hang")
    assert any("start-up never completed" in reason for reason in rc["reasons"])


@pytest.mark.parametrize("slug, rank", [("ext_cerr_np4_r2_plain", 2), ("ext_cerr_np5_r4_tee3", 4)])
def test_an_extension_whose_own_source_does_not_compile_is_the_jobs_code(slug, rank):
    # one node's copy of the load_inline source has an undeclared name: `main.cpp:10:70: error: 'neg_slope' was not
    # declared in this scope` inside `RuntimeError: Error building extension 'fused82'`
    rc = _report(slug)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["exception_type"]) == (
        "python.extension_compile_error", "python_exception", rank, "RuntimeError")


@pytest.mark.parametrize("slug, rank", [("ext_nocxx_np4_r3_plain", 3), ("ext_stale_np4_r1_plain", 1)])
def test_an_extension_build_without_its_toolchain_stays_the_environments(slug, rank):
    # no compiler on PATH (ninja's `c++: not found`), an .so built against another torch: the toolchain, not the code
    rc = _report(slug)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("env.build_ext_failed", "environment", rank)


def test_the_build_error_raised_from_ninjas_failure_is_the_exception_reported():
    # cpp_extension raises RuntimeError("Error building extension ...") from ninja's CalledProcessError
    rc = _report("ext_nocxx_np4_r3_plain")["root_cause"]
    assert rc["exception_type"] == "RuntimeError" and "Error building extension" in rc["text"]


def test_a_barriers_fingerprint_without_a_comma_still_names_the_odd_rank():
    # DETAIL: ranks 0, 2, 3 in ALLREDUCE say `but Rank 1 is running ... CollectiveFingerPrint(SequenceNumber=24OpType=
    # BARRIER)`: rank 1's shard was shorter and it left the loop for the final barrier
    rc = _report("unev_shortshard_np4_r1_detail")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("dist.collective_mismatch", "collective_mismatch", 1)


def test_a_rank_that_said_it_joined_early_under_join_is_no_hang():
    # torch's Join context: rank 3's shard has 5 batches, the others' 7; it prints `joined after 5 steps` and
    # `done`, every rank exits 0 (no launcher summary)
    report = _report("unev_join_ok_np5_rnone_tee3")
    assert report["verdict"] == "ok" and report["root_cause"] is None


def test_a_specific_reading_of_a_remote_error_gets_the_rank_of_the_worker_named():
    # a public paste (pytorch/tutorials#1619): the remote exception printed under `On WorkerInfo(id=0,
    # name=trainer0):` is CUDA's invalid device ordinal; no line carries a rank prefix
    rc = triage([str(SAMPLES.parent / "public61" / "tutorials1619_rpc_ddp_trainer0_invalid_device_ordinal.log")]) \
        .to_dict()["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("cuda.invalid_device_ordinal", "device_assignment", 0)


def test_a_stop_after_the_ranks_progress_drifted_apart_is_a_hang_at_the_odd_rank():
    # rank 3 accumulates under no_sync() for good and runs on to step 6; ranks 0-2 wait in step 1's all-reduce
    # (a 1800 s timeout) until `timeout 40` stops torchrun
    report = _report("ackpt_nosyncnever_np4_r3_hang")
    rc = report["root_cause"]
    assert (report["verdict"], rc["rule_id"], rc["category"], rc["rank"]) == (
        "hung", "hang.stopped_while_waiting", "hang", 3)


@pytest.mark.parametrize("slug, rank", [
    # rank 2's start line says `names ('tp', 'dp')`, every other rank's `names ('dp', 'tp')` (two of them glued on
    # one line); ranks 2 and 3 time out in the tensor-parallel scatter, 0 and 1 lose their peer
    ("dten_dimswap_np4_r2_plain", 2),
    # the same under pdsh-style `worker-K: ` prefixes, two agents of three ranks
    ("dten_dimswap_np6_r4_pdsh2", 4),
])
def test_a_timeout_naming_no_rank_goes_to_the_rank_whose_start_line_differs(slug, rank):
    rc = _report(slug)["root_cause"]
    assert (rc["category"], rc["rank"]) == ("collective_timeout", rank)
    assert any("start-up line" in reason for reason in rc["reasons"])


def test_start_lines_glued_on_one_line_are_each_ranks_own():
    from logtriage.analysis.odd_start import _own_lines
    assert _own_lines(None, "rank 0 world 4 names ('dp', 'tp')rank 3 world 4 names ('dp', 'tp')") == [
        (0, "rank 0 world 4 names ('dp', 'tp')"), (3, "rank 3 world 4 names ('dp', 'tp')")]
    assert _own_lines(2, "world 4 ready") == [(2, "world 4 ready")]
