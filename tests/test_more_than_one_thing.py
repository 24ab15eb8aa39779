"""Readings the 632nd-635th batches of real CPU runs (torch 2.13, sample_logs/cpu_adhoc, labelled before triage ran)
asked for, of logs where more than one thing happens: a handler's call that failed in a `with` of its own
(torch.save's zip writer closing on /dev/full in a `finally:`) is that call's failure, and the exception it was
handling the root; one log record printed by two handlers is one process's announcement of its rank; a bare SIGKILL
in a log with no sign of a GPU is a kill of either kind, not the OOM killer of GPU nodes; and of ranks that raised the
same error, the one whose last progress line is a step before all the others' raised first."""

from __future__ import annotations

from sample_roots import edited_report, facts_of, sample_report


FINALLY = "hyrax_finally_fail_np4_r1_pltee"


def test_a_save_that_failed_in_a_finally_block_is_the_handlers_own_failure():
    # torchrun --tee 3, 4 ranks: rank 1 raised ValueError; its `finally:` torch.save to /dev/full failed in the zip
    # writer's __exit__ ("During handling of the above exception, another exception occurred")
    assert facts_of(sample_report(FINALLY)) == ("python.exception", "python_exception", 1, 13, "ValueError")


def test_without_the_first_exception_the_save_is_the_failure(tmp_path):
    report = edited_report(FINALLY, "[default1]:[rank1]: During handling of the above exception, another exception "
                           "occurred:", "[default1]:", tmp_path)
    assert facts_of(report)[:3] == ("ckpt.write_failed", "checkpoint", 1)


def test_one_record_through_two_log_handlers_is_no_repeated_rank():
    # Lightning Fabric under torchrun, 3 ranks, a control run: every `Initializing distributed: GLOBAL_RANK: N` is
    # printed twice, by Lightning's handler and by the script's timestamped one
    report = sample_report("hyrax_none_np3_rnone_plfabric")
    assert report["verdict"] == "ok" and report["root_cause"] is None


def test_a_bare_sigkill_with_no_sign_of_a_gpu_is_a_kill_of_either_kind():
    # torchrun --tee 3, 5 ranks: rank 3 SIGKILLed itself; the log names neither gloo nor a GPU
    report = sample_report("saguaro_sigkill_np5_r3_tee")
    assert facts_of(report)[:3] == ("signal.sigkill", "crash_signal", 3)


def test_a_bare_sigkill_in_a_log_with_an_nccl_warning_is_the_oom_killer(tmp_path):
    # the same log with one NCCL warning of no consequence (aws-ofi-nccl's plugin skipped): a GPU job
    report = edited_report("saguaro_sigkill_np5_r3_tee", "[default1]:rank 1 step 1 loss",
                           "[default1]:algo-1:249:249 [0] ofi_init:1288 NCCL WARN NET/OFI Only EFA provider is "
                           "supported\n[default1]:rank 1 step 1 loss",
                           tmp_path)
    assert facts_of(report)[:3] == ("host.oom_killer", "host_oom", 3)


def test_of_ranks_that_raised_alike_the_one_a_step_behind_went_first():
    # TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun, 5 ranks: every rank raised the same FloatingPointError, rank 1 at the
    # end of step 3 (its last progress line is step 2), the others at the start of step 4
    rc = sample_report("bilby_same_all_np5_r1_detail")["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["ranks"]) == ("numerical.checked_nonfinite", 1, [0, 1, 2, 3, 4])
