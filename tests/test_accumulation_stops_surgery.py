"""Gradient accumulation, early stopping, data augmentation, model surgery and signal handlers, on real CPU runs
of torch 2.13 (sample_logs/cpu_adhoc, the 104th-108th batches, each labelled before triage ran; the test names
the run)."""

from __future__ import annotations

import pytest

from logtriage.analysis.odd_start import odd_line_out
from logtriage.api import triage
from sample_roots import SAMPLES, root_cause, sample_report, verdict_and_root


@pytest.mark.parametrize("slug, rank", [
    # one worker got SIGTERM from outside (`kill -TERM`), its handler saved a checkpoint and exited 0 (or 143);
    # its peers then lost it in DDP's all-reduce, and torchrun's summary names another rank
    ("preempt_termsave_np4_r2_tee", 2),
    ("preempt_termsave_np6_r4_pdsh2", 4),
    ("preempt_term143_np5_r3_plain", 3),
])
def test_a_workers_own_notice_of_sigterm_before_the_teardown_is_the_stop(slug, rank):
    assert verdict_and_root(slug) == ("failed", "signal.stop_notice", "external_stop", rank)


@pytest.mark.parametrize("slug, expected", [
    # the same notices printed after torchrun's "Sending process N closing signal SIGTERM" are the teardown
    # reaching those workers: the rank's own exception stays the root
    ("clk_late_np6_r4_tee3", ("failed", "python.exception", "python_exception", 4)),
    ("clk_two_np6_r2_tee3", ("failed", "python.exception", "python_exception", 2)),
    ("sigterm_handler_np6_r4_tee", ("failed", "python.exception", "python_exception", 4)),
    ("pl_stall_np4_r3_loglevel", ("failed", "gloo.timeout", "collective_timeout", 3)),
    # rank 2's alarm killed it (-14); the others' handlers printed their SIGTERM notices during the teardown
    ("preempt_alarm_np4_r2_plain", ("failed", "signal.other_signal", "crash_signal", 2)),
])
def test_a_notice_printed_after_the_launchers_sigterms_is_teardown(slug, expected):
    assert verdict_and_root(slug) == expected


def test_a_scheduler_wrappers_preemption_notice_is_the_schedulers_stop():
    # public/submitit_slurm_preempt_requeue: `Caught signal SIGUSR2 on NODE: this job is preempted.` (submitit)
    report = triage([str(SAMPLES.parent / "public" / "submitit_slurm_preempt_requeue.log")]).to_dict()
    assert (report["root_cause"]["rule_id"], report["root_cause"]["line"]) == ("sched.preempted", 1)


@pytest.mark.parametrize("slug", ["aug_none_np4_rnone_plain", "aug_none_np5_rnone_wrapper"])
def test_every_rank_ending_on_done_with_its_counts_finished(slug):
    # each rank's last line is `rank N done samples 256`, and torchrun at its default level says nothing on
    # success: the run finished, it did not stop
    assert sample_report(slug)["verdict"] == "ok"


@pytest.mark.parametrize("slug, rank", [
    # rank 2's loader logged `WARNING: loader failed at step 7 ([Errno 5] Input/output error ...); rebuilding
    # loader and callbacks` and trained on; the run died later of gloo's size abort (patience counter reset),
    # sent by rank 2, whose last line before the abort says another count than the others' (and rank 1, whose
    # early-stop line says `wait 1` where the others say `wait 2`)
    ("estop_patreset_np4_r2_plain", 2),
    ("estop_patreset_np5_r1_tee_trainer", 1),
])
def test_an_error_logged_as_a_warning_that_says_it_rebuilds_is_gone_on_from(slug, rank):
    assert verdict_and_root(slug) == ("failed", "gloo.size_mismatch", "collective_mismatch", rank)


def test_the_one_rank_waiting_for_something_else_is_where_the_job_stuck():
    # surg_stuckgrow_np4_r3_timeout: every rank's last line says it waits (`rank R step 3 surgery: wrote
    # ready_3_R, waiting`) but rank 3's, which wrote ready_4_3; `timeout 120` stopped torchrun
    assert verdict_and_root("surg_stuckgrow_np4_r3_timeout") == (
        "hung", "hang.stopped_while_waiting", "hang", 3)
    assert "all say the same" in " ".join(root_cause("surg_stuckgrow_np4_r3_timeout")["reasons"])


def test_lines_that_differ_only_by_each_ranks_own_number_agree():
    same = {r: f"rank {r} step 3 surgery: wrote ready_3_{r}, waiting" for r in range(4)}
    assert odd_line_out(same) is None
    assert odd_line_out(same | {3: "rank 3 step 3 surgery: wrote ready_4_3, waiting"}) == 3
    # two ranks apart from the rest: no one rank to name
    assert odd_line_out(same | {2: "rank 2 step 4 x", 3: "rank 3 step 5 y"}) is None


def test_a_ranks_own_fingerprint_counts_over_what_another_rank_says_of_it():
    # estop_localstop_np5_r1_detail: ranks 0, 2, 3, 4 report ALLREDUCE of [161] at sequence number 7; rank 1
    # reports BARRIER, and its message names rank 0's `GATHER` of sequence number 0 (DETAIL's check against
    # rank 0), printed before rank 0's own line: rank 0 is what rank 0 says, and rank 1 is the odd one out
    assert verdict_and_root("estop_localstop_np5_r1_detail") == (
        "failed", "dist.collective_mismatch", "collective_mismatch", 1)
