"""A stop that only one rank of a hung run answered: Lightning's handler prints `[rank: N] Received SIGTERM: 15`
only on a rank that is running Python, so the ranks waiting in a collective stay silent and the one that answers
is the rank the run hung on. Real CPU runs of torch 2.13 and Lightning 2.6.6 (sample_logs/cpu_adhoc, the 348th
and 349th batches, labelled before triage ran)."""

from __future__ import annotations

from sample_roots import edited_report, verdict_and_root

NOTICE = "[rank: 2] Received SIGTERM: 15\n"


def test_the_one_rank_that_answered_the_agents_stop_is_where_the_run_hung():
    # torchrun --tee 3 cut by `timeout`: every rank printed step 2, the agent passed SIGTERM on, and only rank 1
    # (stuck in a Python loop) printed Lightning's notice, after the agent's teardown began
    assert verdict_and_root("ocrl_stuck_np3_r1_pltee") == ("hung", "hang.stopped_while_waiting", "hang", 1)


def test_a_lone_notice_that_ends_the_log_is_a_hang_not_a_preemption():
    # a bash loop of four ranks, no launcher: all printed step 1, the loop's SIGTERM reached every rank and only
    # rank 2 (stuck before step 2's reduce) answered; nothing follows the notice
    assert verdict_and_root("pfam_msa_np4_r2_plbashloop") == ("hung", "hang.stopped_while_waiting", "hang", 2)


def test_every_rank_answering_is_a_stop_of_a_live_job(tmp_path):
    # the same run had every rank been running Python: each answers, nothing points at one
    every = "".join(f"[rank: {r}] Received SIGTERM: 15\n" for r in (0, 1, 3)) + NOTICE
    rc = edited_report("pfam_msa_np4_r2_plbashloop", NOTICE, every, tmp_path)["root_cause"]
    assert rc["category"] == "external_stop"


def test_a_lone_notice_with_output_after_it_stays_a_stop(tmp_path):
    # a rank that went on printing after the notice: the log does not end in the wait
    report = edited_report("pfam_msa_np4_r2_plbashloop", NOTICE, NOTICE + "rank 0 step 2 loss 2.0880 acc 0.109\n",
                           tmp_path)
    assert (report["verdict"], report["root_cause"]["category"], report["root_cause"]["rank"]) == (
        "failed", "external_stop", 2)


def test_two_ranks_answering_name_no_rank(tmp_path):
    rc = edited_report("ocrl_stuck_np3_r1_pltee", "[default1]:[rank: 1] Received SIGTERM: 15",
                       "[default1]:[rank: 1] Received SIGTERM: 15\n[default0]:[rank: 0] Received SIGTERM: 15",
                       tmp_path)["root_cause"]
    assert (rc["category"], rc["rank"]) == ("hang", None)
