"""Readings the 636th-639th batches of real CPU runs (torch 2.13, sample_logs/cpu_adhoc, labelled before triage ran)
asked for, of mistakes in the training loop's own code: a script's FloatingPointError over its mixed-precision loss
scaler is its own finiteness check; a run whose last line is rank 0's saved export with a summary after a comma ended;
and gloo's size abort whose ring neighbour (the rank that sends to it) is the one rank a step behind the others names
that neighbour, which made a collective the others did not."""

from __future__ import annotations

from sample_roots import edited_report, facts_of, sample_report

SCALER = "gerenuk_gradscaler_np4_r1_filter"
CONTROL = "gerenuk_none_np8_rnone_plain"
EXTRA = "gerenuk_nosync_np5_r3_wrapper"


def test_a_check_of_the_loss_scaler_is_the_scripts_own_finiteness_check():
    # torchrun --tee 3 --local-ranks-filter 0,1, 4 ranks: bf16 autocast with a GradScaler; rank 1's check raised
    # "FloatingPointError: rank 1: GradScaler skipped 2 steps in a row, loss scale 2048.0 -> 1024.0"
    assert facts_of(sample_report(SCALER)) == ("numerical.checked_nonfinite", "numerical", 1, 17,
                                               "FloatingPointError")


def test_a_floating_point_error_naming_no_value_or_scaler_is_an_exception(tmp_path):
    report = edited_report(SCALER, "GradScaler skipped 2 steps in a row, loss scale 2048.0 -> 1024.0",
                           "too many skipped steps", tmp_path)
    assert facts_of(report)[:3] == ("python.exception", "python_exception", 1)


def test_a_saved_export_with_a_summary_after_it_ends_the_run():
    # plain torchrun, 8 ranks, a control run: the log ends on "rank 0 saved export, mean final loss 0.4724"
    report = sample_report(CONTROL)
    assert report["verdict"] == "ok" and report["root_cause"] is None


def test_a_save_at_a_step_does_not_end_the_run(tmp_path):
    report = edited_report(CONTROL, "rank 0 saved export, mean final loss 0.4724",
                           "rank 0 saved export, at step 5", tmp_path)
    assert report["verdict"] == "hung" and report["root_cause"]["rule_id"] == "hang.output_stopped"


def test_the_ring_neighbour_a_step_behind_sent_the_odd_size():
    # a job script around torchrun, 5 ranks: rank 3 ran one DDP micro-batch more outside no_sync(); rank 2 aborted
    # on gloo's "68 vs 4. Received data size doesn't match"; rank 3 alone never printed step 5
    assert facts_of(sample_report(EXTRA))[:4] == ("gloo.size_mismatch", "collective_mismatch", 3, 34)


def test_with_every_rank_at_the_same_step_the_aborting_rank_stays(tmp_path):
    step4 = "rank 3 step 4 loss 0.3133 browse_reach 1.431"
    report = edited_report(EXTRA, step4, f"{step4}\nrank 3 step 5 loss 0.3133 browse_reach 1.431", tmp_path)
    assert facts_of(report)[:3] == ("gloo.size_mismatch", "collective_mismatch", 2)
