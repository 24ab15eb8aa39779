"""The SIGTERM mp.spawn's exception names, which spawn did not send; numbers with a sign are numbers aside like
any others; a missing piece of data whose name joins words before its number; in a hang stopped from outside, the
rank that stayed at a line every other rank went on from; a metric named `TD-error` is no error line; a KeyError
computing torch.load's path. Real CPU runs of torch 2.13 (sample_logs/cpu_adhoc, the 240th-254th batches, each
labelled before triage ran; the test names the run)."""

from __future__ import annotations

from logtriage.analysis.findings import mask_numbers
from sample_roots import edited_report, root_facts, verdict_and_root


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
    assert root_facts("clkm_nolog_np3_r2_legacy")[:3] == ("data.file_not_found", "python_exception", 2)
    # a relative `data/conf_train_dedup_r2.pt` on rank 2 under Open MPI's tags
    assert root_facts("schn_nofile_np3_r2_mpitag")[:3] == ("data.file_not_found", "python_exception", 2)


def test_the_rank_that_stayed_at_a_line_every_other_rank_went_on_from_is_the_one_they_waited_for():
    # --tee 3: every rank prints `rank N: sliding-window validation, window 12, stride ...`; ranks 0, 1 and 3 then
    # `rank N: 64 windows in 0.9s`, rank 2 (stride 1) nothing more; `timeout` stops the job (247th batch)
    assert verdict_and_root("med3_slidewin_np4_r2_tee") == ("hung", "hang.stopped_while_waiting", "hang", 2)


def test_where_every_rank_went_on_from_the_shared_line_none_stayed(tmp_path):
    # the same run with rank 2's `64 windows` line after its own: every rank ended on one line, no rank is named
    report = edited_report("med3_slidewin_np4_r2_tee", "rank 2: sliding-window validation, window 12, stride 1",
                           "rank 2: sliding-window validation, window 12, stride 1\n"
                           "[default2]:rank 2: 64 windows in 0.9s", tmp_path)
    assert report["verdict"] == "hung" and report["root_cause"]["rank"] is None


def test_a_compound_with_error_in_a_metric_is_no_error_line():
    # a clean run's last line `rank 0: 0 episodes, mean return 0.000, TD-error median bin 0/20` (246th batch):
    # the output stops (a hang by issue 2's rule), no unknown error fails it
    assert verdict_and_root("pdqn_none_np3_rnone_plain")[:2] == ("hung", "hang.output_stopped")


def test_a_key_error_computing_torch_loads_path_is_no_checkpoints_missing_key():
    # `target = torch.load(f"{WORK}/{pat_dir}/{REGISTRY[pattern]}")` as the innermost frame, `KeyError: 'gecko'`:
    # the call never ran (torch's own errors raise inside serialization.py), so the file's format is not at fault
    assert root_facts("nca_pattern_np4_r1_tee")[:3] == ("python.exception", "python_exception", 1)
    assert root_facts("nca_pattern_np3_r2_legacy")[:3] == ("python.exception", "python_exception", 2)


def test_a_collectives_tensors_of_another_dtype_on_one_rank_is_a_collective_mismatch():
    # `ValueError: Invalid usage of tensors with different dtypesFound torch.int64 and  torch.float32` from
    # torch's own check in all_gather on rank 1, whose empty list of lengths became a float tensor (257th batch)
    assert root_facts("rcpt_lengths_np4_r1_plain")[:3] == ("dist.tensor_dtype_mismatch", "collective_mismatch", 1)


def test_a_rank_that_went_on_alone_names_the_hang_when_no_line_dates_the_jobs_start():
    # plain torchrun with OMP_NUM_THREADS set prints no banner: the stop is the first stamped line; rank 2's
    # `re-mining hard negatives over all 24 shard images before step 2` after its step 1, the others at step 1
    assert verdict_and_root("vse_mine_np3_r2_plain") == ("hung", "hang.stopped_while_waiting", "hang", 2)
