"""Readings the 564th-579th batches of real CPU runs (torch 2.13, sample_logs/cpu_adhoc, labelled before triage ran)
asked for: ranks that timed out before printing any step while every other rank printed one and went past were in a
collective the others had left behind (Lightning runs whose metric all_reduce had another size on one rank); a rank
that had printed a later step than the waiting ranks was not late to their collective; c10d's `Operation timed out!`
from `work.wait(timeout=...)` is a collective timeout; a clean run's last line `rank 0 wrote ... export` ends it; a
few ranks waiting in another call of the same collective (told apart by the program's line) are named together; and
waits an outside stop ended on every rank but one name that one, which had not reached the collective."""

from __future__ import annotations

import pytest
from sample_roots import SAMPLES, edited_report, root_facts, sample_report, verdict_and_root

from logtriage.api import TriageOptions, run_triage


def test_the_one_rank_that_timed_out_before_any_step_took_another_path():
    # Fabric under torchrun, 4 ranks: rank 3's metric all_reduce had 7 elements, the others' 4. Ranks 0-2 printed
    # step 0 and went on, rank 3 timed out in gloo's recv, then ranks 1 and 2 lost their connections to it
    rule, category, rank, line, exception = root_facts("basalt_allreduce_size_np4_r3_plfabric")
    assert (rule, category, rank, line, exception) == ("gloo.timeout", "collective_timeout", 3, 26, "RuntimeError")


def test_two_ranks_that_timed_out_before_any_step_are_named_together():
    # Lightning under torchrun, 6 ranks: ranks 2 and 3 timed out sending, ranks 0, 1, 4 and 5 had printed step 0;
    # which of the two took the other path is not in the log (their timeouts end alike), so no one rank is claimed;
    # rank 5's `[rank: 5] Received SIGTERM: 15` after rank 2's timeout is the agent's teardown, not late work
    report = sample_report("basalt_allreduce_size_np6_r2_pltorchrun")
    rc = report["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["ranks"]) == ("gloo.timeout", None, [2, 3])
    assert "before printing any step" in " ".join(rc["reasons"])


def test_with_a_step_printed_by_the_waiters_the_others_are_not_past_them(tmp_path):
    # the same run had ranks 2 and 3 printed step 0 too: nothing sets the waiting ranks apart from the rest any more
    both = "rank 2 step 0 loss 0.5500 hexfrac 0.083\nrank 3 step 0 loss 0.5400 hexfrac 0.083\nrank 0 step 0 loss"
    report = edited_report("basalt_allreduce_size_np6_r2_pltorchrun", "rank 0 step 0 loss", both, tmp_path)
    rc = report["root_cause"]
    assert "before printing any step" not in " ".join(rc["reasons"])
    assert (rc["category"], rc["rule_id"]) == ("collective_timeout", "gloo.timeout") and rc["ranks"] != [2, 3]


def test_a_rank_that_printed_the_waiters_step_and_then_the_agents_sigterm_was_late():
    # Lightning under LOGLEVEL=INFO torchrun, 3 ranks: rank 2 spent 40 s in pure Python after step 1; rank 1 timed
    # out, rank 0 lost the connection; rank 2, at the same step as rank 1, was still at work when the agent stopped it
    assert root_facts("weir_slow_np3_r2_plloglevel")[:3] == ("gloo.timeout", "collective_timeout", 2)


def test_c10d_work_wait_timeout_is_a_collective_timeout_and_the_slow_rank_is_named():
    # Lightning under LOGLEVEL=INFO torchrun, 4 ranks: after step 2 rank 2 is busy for ~45 s; ranks 0, 1 and 3 raise
    # `RuntimeError: Operation timed out!` from w.wait(timeout=...), rank 2 prints step 3 and then loses its peers
    rule, category, rank, line, exception = root_facts("ochre_slow_np4_r2_plloglevel")
    assert (rule, category, rank, line, exception) == (
        "dist.work_wait_timeout", "collective_timeout", 2, 179, "RuntimeError")


def test_the_same_wait_on_six_ranks():
    assert root_facts("ochre_slow_np6_r1_pltorchrun")[:3] == ("dist.work_wait_timeout", "collective_timeout", 1)


def test_a_clean_run_whose_last_line_says_it_wrote_its_export_is_ok(tmp_path):
    # accelerate launch, 3 ranks, the clean control: `rank 0 wrote till classifier export` ends the log
    assert sample_report("moraine_none_np3_rnone_acc")["verdict"] == "ok"
    assert sample_report("moraine_none_np3_rnone_hf")["verdict"] == "ok"
    report = edited_report("moraine_none_np3_rnone_acc", "rank 0 wrote till classifier export",
                           "rank 0 writing till classifier export", tmp_path)
    assert (report["verdict"], report["root_cause"]["rule_id"]) == ("hung", "hang.output_stopped")


def test_two_ranks_in_another_call_of_the_same_collective_are_named_together():
    # torchrun, 6 ranks: rank 2's metric all_reduce (called at line 148) had 7 elements where the others sent 4;
    # ranks 2 and 3 timed out in that call, ranks 1, 4 and 5 in the gradient all_reduce called at line 141 (rank 0
    # lost its connection there): the report names ranks 2-3, and no one of them, since their timeouts end alike
    rc = sample_report("shrike_wrong_size_np6_r2_plain")["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["ranks"]) == ("gloo.timeout", None, [2, 3])
    assert "all_reduce at fault576.py:148" in " ".join(rc["reasons"])


@pytest.mark.parametrize("engine", ["exact", "fast"])
def test_the_call_site_of_a_collective_is_the_last_frame_outside_torch(engine):
    # each traceback runs main() -> dist.all_reduce -> c10d_logger's wrapper -> distributed_c10d: the site is the
    # program's own frame, not torch's wrapper, and the exact and fast scans record the same
    run = run_triage([str(SAMPLES / "shrike_wrong_size_np6_r2_plain.log")], TriageOptions(engine=engine))
    sites = {run.diagnosis.keys[run.scan.slots.final(run.scan.block_slots[block])].rank: site
             for block, site in run.scan.block_collective_sites.items()}
    assert sites == {0: "fault576.py:141", 1: "fault576.py:141", 2: "fault576.py:148", 3: "fault576.py:148",
                     4: "fault576.py:141", 5: "fault576.py:141"}


def test_one_rank_alone_in_another_call_is_no_group(tmp_path):
    # the same log with rank 3's call moved to line 141: rank 2 alone waited at line 148, which the group reading
    # leaves to the odd-one-out readings (and those compare the collective's name, the same all_reduce for all)
    report = edited_report("shrike_wrong_size_np6_r2_plain",
                           '[rank3]:   File "/work/main/sample_logs/cpu_adhoc/fault576.py", line 148, in main',
                           '[rank3]:   File "/work/main/sample_logs/cpu_adhoc/fault576.py", line 141, in main', tmp_path)
    rc = report["root_cause"]
    assert rc["rule_id"] == "gloo.timeout" and rc["ranks"] != [2, 3]
    assert not any("waited in `all_reduce at" in reason for reason in rc["reasons"])


def test_waits_a_stop_ended_name_the_rank_that_had_not_reached_the_collective():
    # Lightning under torchrun, 3 ranks, process-group timeout 300 s: rank 2 stalled after step 2; `timeout` sent
    # SIGTERM a minute in, and after it ranks 0 and 1 report their all_gather's 300000 ms wait as timed out while
    # rank 2 only lost its peers: the stop ended the hang rank 2 caused
    assert verdict_and_root("sorrel_hang_np3_r2_pltorchrun") == ("hung", "hang.stopped_while_waiting", "hang", 2)


def test_a_stop_with_no_rank_left_waiting_stays_a_stop(tmp_path):
    # the same run had rank 2 timed out too: no rank stands apart, the stop is the report
    report = edited_report("sorrel_hang_np3_r2_pltorchrun",
                           "[rank2]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                           "Connection closed by peer [127.0.0.1]:2978.",
                           "[rank2]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                           "unbound_buffer.cc:78] Timed out waiting 300000ms for recv operation to complete.", tmp_path)
    assert (report["verdict"], report["root_cause"]["rule_id"]) == ("failed", "launcher.signal_exception")


def test_ranks_that_timed_out_a_step_behind_the_ones_that_went_past_are_named_together():
    # Fabric under torchrun, 4 ranks: rank 1's metric all_reduce had 5 elements, the others' 4. Ranks 0 and 3
    # printed step 3 and went on (to lose their connections in backward); ranks 1 and 2 timed out after step 2
    rc = sample_report("bittern_allreduce_size_np4_r1_plfabric")["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["ranks"]) == ("gloo.timeout", None, [1, 2])
    assert "after step 2" in " ".join(rc["reasons"])


def test_a_clean_run_whose_last_line_says_it_exported_its_model_is_ok(tmp_path):
    # torchrun --tee 3, 4 ranks, the clean control: `[default0]:rank 0 exported burrow model` ends the log
    assert sample_report("wombat_none_np4_rnone_tee")["verdict"] == "ok"
    report = edited_report("wombat_none_np4_rnone_tee", "rank 0 exported burrow model", "rank 0 exporting burrow model",
                           tmp_path)
    assert report["verdict"] == "hung"


def test_a_clean_run_whose_last_line_says_it_finished_its_classifier_is_ok(tmp_path):
    # a transformers.Trainer run under accelerate launch, 3 ranks, the clean control: the Trainer's own records,
    # then `rank 0 finished chamber classifier`
    assert sample_report("nautilus_none_np3_rnone_hfacc")["verdict"] == "ok"
    report = edited_report("nautilus_none_np3_rnone_hfacc", "rank 0 finished chamber classifier",
                           "rank 0 finished chamber classifier warmup, waiting", tmp_path)
    assert report["verdict"] == "hung"
