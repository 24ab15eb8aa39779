"""The SIGTERM mp.spawn's exception names, which spawn did not send; numbers with a sign are numbers aside like
any others; a missing piece of data whose name joins words before its number. Real CPU runs of torch 2.13
(sample_logs/cpu_adhoc, the 240th-244th batches under hand-made launchers, each labelled before triage ran; the
test names the run)."""

from __future__ import annotations

from logtriage.analysis.findings import mask_numbers
from sample_roots import root_facts, verdict_and_root


def test_the_child_spawns_exception_names_died_of_a_sigterm_spawn_did_not_send():
    # `ProcessExitedException: process 2 terminated with signal SIGTERM`; spawn's own `Terminating process 27211
    # via signal SIGTERM` lines come for the other children only after it
    assert root_facts("clkm_sigterm_np3_r2_spawn")[:3] == ("signal.sigterm_unsent", "crash_signal", 2)


def test_a_value_with_a_sign_is_masked_as_one_without():
    assert mask_numbers("rank 1: local validation pearson -0.1297 on 24 pairs") == \
        mask_numbers("rank 3: local validation pearson 0.1167 on 24 pairs")
    # a dash between words or numbers is no sign
    assert mask_numbers("shard 3-4 of x-1") == "shard #-# of x-#"


def test_the_rank_that_went_on_past_a_line_whose_values_differ_in_sign_is_the_one_they_waited_for():
    # a bash loop of one python per rank: every rank's last line `rank N: local validation pearson ±0.04 on 24
    # pairs`; rank 2 then `rank 2: back-translating all 2000 validation sentences ...`; `timeout` kills it silently
    assert verdict_and_root("qest_backtrans_np4_r2_bashloop") == ("hung", "hang.output_stopped", "hang", 2)


def test_a_missing_piece_whose_name_joins_words_before_its_number_is_data():
    # torch.load of `/tmp/job_work/sessions/clicks_part2.pt` on rank 2 under the legacy launcher
    assert root_facts("clkm_nolog_np3_r2_legacy")[:3] == ("python.file_not_found", "python_exception", 2)
    # a relative `data/conf_train_dedup_r2.pt` on rank 2 under Open MPI's tags
    assert root_facts("schn_nofile_np3_r2_mpitag")[:3] == ("python.file_not_found", "python_exception", 2)
