"""Two readings the 370th-379th batches of real CPU runs (torch 2.13, sample_logs/cpu_adhoc, labelled before triage
ran) asked for: rank 0 whose last line, after every rank's last step, says it waits is where a hung run stuck (not a
summary rank 0 logs for all); and a script's own `ERROR: rank N: ...` line (the level, a colon, the rank) is its
logged error, the cause of the exit code that follows."""

from __future__ import annotations

from sample_roots import edited_report, root_facts, verdict_and_root

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
