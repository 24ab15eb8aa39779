"""A clean run whose console ends on the program saying it saved what it trained, or that it is done, with the
other ranks' last steps flushed after it; rank 0's own work before it starts as the others do, or on its way to
the line every rank ended on, which names no rank in a hang. Real CPU runs of torch 2.13 (sample_logs/cpu_adhoc, the
235th-274th batches and earlier ones, each labelled before triage ran; the test names the run)."""

from __future__ import annotations

import pytest

from logtriage.api import triage
from sample_roots import SAMPLES, edited_report, sample_report, verdict_and_root


@pytest.mark.parametrize("slug", [
    # plain torchrun prints nothing on success: `eval: mean PSNR ...`, then `saved denoiser to .../dae_final.pt`
    "dae_none_np3_rnone_plain",
    # --tee 3: rank 0's `saved /tmp/job_work/ltr_scorer_final.pt`, then rank 1's steps 0-3 flushed after it
    "ltr_none_np3_rnone_tee",
    # a logging format that carries the rank: `[rank=0] INFO saved hypernetwork to .../hnet_final.pt after 12 steps`
    "hnet_none_np4_rnone_logfmt",
    # `rank 0 done: final ll/event -1.9145, saved hawkes_final.pt`
    "hawk_none_np4_rnone_wrapper",
    # a name of more than one word and a value with a sign: `rank 0 done: 5 updates, mean return -0.300`
    "ppog_none_np3_rnone_bashloop",
    # no rank's label: `anomaly detection done: precision 1.000 recall 0.379, 11 windows flagged on 3 machines`
    "tcna_none_np3_rnone_bashloop",
])
def test_a_run_that_ends_on_saving_its_result_finished(slug):
    report = sample_report(slug)
    assert (report["verdict"], report["root_cause"]) == ("ok", None)


@pytest.mark.parametrize("old, new", [
    # the rank that saved says more after it: its save was not its last word
    ("saved /tmp/job_work/ltr_scorer_final.pt", "saved /tmp/job_work/ltr_scorer_final.pt\\n[default0]:rank 0 step 4"),
    # a save at a step is a checkpoint a run that goes on writes at each interval
    ("saved /tmp/job_work/ltr_scorer_final.pt", "saved /tmp/job_work/ltr_scorer_step3.pt"),
    # another rank went past the step the save came after
    ("[default1]:rank 1 step 3 loss", "[default1]:rank 1 step 9 loss"),
])
def test_output_that_goes_on_past_the_save_still_stops(old, new, tmp_path):
    text = (SAMPLES / "ltr_none_np3_rnone_tee.log").read_text()
    assert old in text
    report = edited_report("ltr_none_np3_rnone_tee", old, new.replace("\\n", "\n"), tmp_path)
    assert report["verdict"] == "hung" and report["root_cause"]["category"] == "hang"


def test_a_frameworks_own_record_of_a_save_is_no_end_of_the_run():
    # DeepSpeed's `[INFO] [engine.py:1818:_save_zero_checkpoint] zero checkpoint saved ...` and then nothing: the
    # job never exited (public24, labelled hung)
    log = SAMPLES.parent / "public24" / "neox473_deepspeed_medium_end_of_training_checkpoint_saved_then_never_exits.log"
    assert triage([str(log)]).to_dict()["verdict"] == "hung"


def test_rank_0_logging_more_on_its_way_to_the_line_every_rank_ended_on_names_no_rank():
    # start-up stopped by `timeout`: every rank's last line is `rank N loaded hawkes_m5.pt`; rank 0 printed
    # `rank 0 windows per rank [4, 4, 4, 4], events 512` and its own `loaded` line after the others fell silent
    # (the slow rank, 2, printed nothing of its own: the label's rank is a known miss)
    assert verdict_and_root("hawk_slowmc_np4_r2_loglevel") == ("hung", "hang.stopped_while_waiting", "hang", None)


def test_another_rank_saying_more_on_its_way_to_the_shared_last_line_is_the_one_they_waited_for():
    # rank 1's `rank 1: interior partition, halo exchange skipped` and then the `rank N world 4 partition ...` line
    # every rank ended on: it went its own way (a rank that skipped the halo exchange the others wait in)
    assert verdict_and_root("gnn_nohalo_np4_r1_timeout") == ("hung", "hang.stopped_while_waiting", "hang", 1)


def test_rank_0_preparing_for_all_before_it_starts_as_they_do_was_not_set_up_its_own_way():
    # `rank 0 wrote 128 HR patches and the feature net to /tmp/job_work/sr`, then `rank 0 train 32 patches 24x24`
    # as every other rank's first line; all reach step 4 and `timeout` stops the hang (rank 2's silent save)
    assert verdict_and_root("supr_slowsave_np3_r2_plain") == ("hung", "hang.stopped_while_waiting", "hang", None)


def test_a_rank_whose_first_line_alone_differs_was_set_up_its_own_way(tmp_path):
    # the same run with rank 0's preparing line but not its shared one: its start-up differs from all the others'
    report = edited_report("supr_slowsave_np3_r2_plain", "rank 0 train 32 patches 24x24, val 10, scale x2\n", "",
                           tmp_path)
    assert report["root_cause"]["rank"] == 0


def test_rank_0_saying_it_is_done_after_the_last_step_every_rank_printed_finished():
    # a bash loop of one python per rank: every rank's `rank N step 4 ...`, then rank 0's `rank 0 done: 5 steps,
    # final global loss 0.11282` (254th batch)
    report = sample_report("nca_none_np3_rnone_bashloop")
    assert (report["verdict"], report["root_cause"]) == ("ok", None)


def test_a_rank_that_says_done_before_another_rank_steps_past_it_has_not_finished(tmp_path):
    # the same run with rank 2 printing a step past rank 0's last after rank 0 said done: an uneven loop
    report = edited_report("nca_none_np3_rnone_bashloop", "rank 0 done: 5 steps, final global loss 0.11282",
                           "rank 0 done: 5 steps, final global loss 0.11282\nrank 2 step 5 loss 0.08", tmp_path)
    assert report["verdict"] == "hung"


@pytest.mark.parametrize("old, new", [
    # a sign-off that goes on to wait for the others is no end
    ("rank 0 done: 5 updates, mean return -0.300", "rank 0 done: 5 updates, waiting for peers 3"),
    ("rank 0 done: 5 updates, mean return -0.300", "rank 0 done, retrying the upload 3"),
])
def test_a_done_line_that_goes_on_to_wait_is_no_end(old, new, tmp_path):
    report = edited_report("ppog_none_np3_rnone_bashloop", old, new, tmp_path)
    assert report["verdict"] == "hung" and report["root_cause"]["category"] == "hang"


def test_a_rank_that_went_on_alone_behind_a_loggers_name_names_the_hang():
    # `2026-12-05 15:39:51,756 INFO vqvae: rank 2: re-initialising dead codes with k-means` after rank 2's step 1,
    # the others' step 1 and nothing more before `timeout` stopped the job: rank 2 left the loop they waited in
    assert verdict_and_root("vqv_kmeans_np3_r2_plain") == ("hung", "hang.stopped_while_waiting", "hang", 2)


@pytest.mark.parametrize("slug", [
    # every rank's last line is `rank N: recall@5 0.1146 (global hits 22/192)` after its step 4, and nothing more
    "poi_none_np3_rnone_plain",
    "tsad_none_np3_rnone_bashloop",
])
def test_a_run_whose_ranks_all_end_on_the_same_result_finished(slug):
    report = sample_report(slug)
    assert (report["verdict"], report["root_cause"]) == ("ok", None)


@pytest.mark.parametrize("old, new", [
    # one rank says something else last: not the same result on every rank
    ("[rank 1]: recall@5", "rank 1: waiting for rank 0's"),
    # the shared last line says it is waiting
    ("(global hits 22/192)", "(waiting for the report 3)"),
])
def test_ranks_ending_on_lines_that_differ_or_wait_still_stop(old, new, tmp_path):
    text = (SAMPLES / "poi_none_np3_rnone_plain.log").read_text()
    old = old if old in text else old.replace("[rank 1]:", "rank 1:")
    assert old in text
    report = edited_report("poi_none_np3_rnone_plain", old, new, tmp_path)
    assert report["verdict"] == "hung" and report["root_cause"]["category"] == "hang"

