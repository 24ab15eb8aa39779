"""Readings the 588th-599th batches of real CPU runs (torch 2.13, sample_logs/cpu_adhoc, labelled before triage ran)
asked for: a rank that printed a later step than the rank whose wait an earlier reading named was past that
collective, not late to it, even where another rank timed out later, in a later collective."""

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
