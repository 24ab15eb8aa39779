"""Readings the 370th-384th batches of real CPU runs (torch 2.13, sample_logs/cpu_adhoc, labelled before triage ran)
asked for: rank 0 whose last line, after every rank's last step, says it waits is where a hung run stuck (not a
summary rank 0 logs for all); a script's own `ERROR: rank N: ...` line (the level, a colon, the rank) is its logged
error, the cause of the exit code that follows; a rank's word that it saved its result to a folder ends the run; and
a non-finite loss every rank printed alike names no rank, the one rank whose own check raised does."""

from __future__ import annotations

from sample_roots import edited_report, root_facts, sample_report, verdict_and_root

WAIT = "[rank 0] rank 0 waiting for render lock /tmp/job_work/render.lock.done\n"


def test_rank_0_waiting_alone_after_the_last_step_is_where_the_run_hung():
    # a bash loop of 3 ranks through sed labels, cut by `timeout`: every rank printed step 2, then rank 0 alone
    # printed that it waits for a lock file; the loop's `Terminated` lines end the log
    assert verdict_and_root("hmer_stuck_np3_r0_ranklabel") == ("hung", "hang.output_stopped", "hang", 0)


def test_rank_0_saying_it_saved_a_result_there_is_a_summary_not_a_wait(tmp_path):
    saved = "[rank 0] rank 0 saved the expression vocabulary to /tmp/job_work/vocab.json\n"
    rc = edited_report("hmer_stuck_np3_r0_ranklabel", WAIT, saved, tmp_path)["root_cause"]
    assert (rc["category"], rc["rank"]) == ("hang", None)


def test_a_bare_level_a_colon_and_the_rank_is_the_scripts_own_error():
    # python -m torch.distributed.run, 3 ranks: `ERROR: rank 2: buoy 46002 mooring drift 2.7 km exceeds ...` then
    # sys.exit(4); rank 0 meets the closed connection, the agent's Root Cause is rank 2's exit code 4
    rule, category, rank, line, _ = root_facts("wavh_exit4_np3_r2_pymodule")
    assert (rule, category, rank, line) == ("python.logged_error", "python_exception", 2, 14)


def test_the_same_line_under_lightnings_own_launcher():
    # Lightning starts ranks 1.. itself; rank 0 printed `ERROR: rank 0: ...` and left with exit 4
    assert root_facts("drns_exit4_np5_r0_plown")[:3] == ("python.logged_error", "python_exception", 0)


def test_a_rank_that_saved_its_result_to_a_folder_ended_the_run(tmp_path):
    # accelerate launch, 3 ranks, the clean control: the last line is `rank 0 saved export/ after 6 steps` (a folder
    # path, its trailing slash) and the launcher prints nothing on success
    assert sample_report("sgnl_none_np3_rnone_acc")["verdict"] == "ok"
    # without that line the output just stops after the ranks' gathers: nothing says the run ended
    report = edited_report("sgnl_none_np3_rnone_acc", "rank 0 saved export/ after 6 steps\n", "", tmp_path)
    assert (report["verdict"], report["root_cause"]["rule_id"]) == ("hung", "hang.output_stopped")


def test_a_nan_every_rank_printed_alike_names_no_rank_the_one_check_that_raised_does():
    # torchrun --tee 3, 5 ranks: rank 3's features are inf, so the reduced loss every rank prints is nan from step 1;
    # at step 3 rank 3's own check raises `FloatingPointError: non-finite velocity features on rank 3 at step 3`
    rule, category, rank, line, exception = root_facts("sgnl_nanvel_np5_r3_tee")
    assert (rule, category, rank, line, exception) == (
        "numerical.checked_nonfinite", "numerical", 3, 26, "FloatingPointError")


def test_a_nan_one_rank_printed_finite_is_no_reduced_loss(tmp_path):
    # the same run with rank 1's step-1 loss finite: the ranks' losses differ, so the nan lines are each rank's own;
    # rank 3's own nan line (before rank 0's, 4's and 2's) dates its check, and the shared-loss reading stays out
    report = edited_report("sgnl_nanvel_np5_r3_tee", "rank 1 step 1 loss nan acc 0.050",
                           "rank 1 step 1 loss 3.1020 acc 0.050", tmp_path)
    rc = report["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("numerical.checked_nonfinite", 3)
    assert not any("alike" in reason for reason in rc["reasons"])
