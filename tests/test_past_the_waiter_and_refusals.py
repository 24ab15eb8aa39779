"""Readings the 588th-599th batches of real CPU runs (torch 2.13, sample_logs/cpu_adhoc, labelled before triage ran)
asked for: a rank that printed a later step than the rank whose wait an earlier reading named was past that
collective, not late to it, even where another rank timed out later, in a later collective; and a script's ERROR
line that ends on its refusal to go on (`...; refusing to train on an empty field`) is the error it exited with."""

from __future__ import annotations

from sample_roots import edited_report, sample_report

SLUG = "puffinx_wrong_size_np4_r2_pltorchrun"


def test_a_rank_past_the_lone_waiters_step_is_not_late_to_its_collective():
    # Lightning under torchrun, 4 ranks: rank 2's metric all_reduce had 5 values, its peers' 4. Rank 2 alone timed
    # out (c10d's `Operation timed out!` after step 2); ranks 0, 1 and 3 printed step 3 and went on, rank 0 later
    # timed out in a recv of the next collective and ranks 1 and 3 lost their connections
    rc = sample_report(SLUG)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"], rc["exception_type"]) == (
        "dist.work_wait_timeout", "collective_timeout", 2, 147, "RuntimeError")
    assert not any("did not time out" in reason for reason in rc["reasons"])


def test_without_its_later_step_the_rank_at_work_after_the_wait_is_the_late_one(tmp_path):
    # the same run had rank 1 printed step 2 again where it printed step 3: it was then still at work in the step
    # the waiting rank had reached, and came to the collective late
    report = edited_report(SLUG, "rank 1 step 3 loss 293.9467", "rank 1 step 2 loss 293.9467", tmp_path)
    rc = report["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("dist.work_wait_timeout", 1)
    assert any("did not time out" in reason for reason in rc["reasons"])


REFUSED = "drumlin_logged_exit_np4_r1_spawn"
REFUSAL = "; refusing to train on an empty field"


def test_an_error_line_ending_on_a_refusal_to_go_on_is_the_logged_error():
    # mp.spawn, 4 ranks: rank 1 logged `ERROR drumlin: field clew_bay_1 has 0 usable drumlins ...; refusing to train
    # on an empty field` and exited 4 ('terminate called without an active exception' after it); mp.spawn then
    # reported process 0's lost connection. The line names no rank (its field name is rank 1's shard), so the
    # rank stays the launcher's reading; the error is the script's own, not the abort after it
    rc = sample_report(REFUSED)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["line"]) == ("python.logged_error", "python_exception", 13)


def test_the_same_error_line_without_the_refusal_is_no_logged_error(tmp_path):
    # without its refusal the line is an ERROR record like any other: the abort after it is what the log shows
    rc = edited_report(REFUSED, REFUSAL, "", tmp_path)["root_cause"]
    assert rc["rule_id"] != "python.logged_error"
    assert (rc["rule_id"], rc["category"], rc["line"]) == ("signal.terminate_no_exception", "crash_signal", 14)
