"""Runs started without torchrun's flags (a bash loop of one python per rank, its output bare or labelled as
srun, Open MPI or a user's sed would, mp.spawn, the legacy launcher, a logging format that carries the rank,
a folder of per-rank files): no agent stops the late rank, so it times out too late to be missing, or the
output just stops with it elsewhere; bash reports a signal as a job notice; mp.spawn's parent names the
child. Real CPU runs of torch 2.13 (sample_logs/cpu_adhoc, the 195th-199th batches, each labelled before
triage ran; the test names the run)."""

from __future__ import annotations

import pytest

from sample_roots import edited_report, root_facts, sample_report, verdict_and_root


def test_a_logged_error_whose_format_carries_the_rank_before_the_level_is_the_ranks_failure():
    # `2026-12-05 07:17:01,594 [rank=1] ERROR rank 1: sensor clock skew 4.2 s exceeds 1.0 s ...; refusing to score`,
    # then exit 2 (torchrun's `failed (exitcode: 2) local_rank: 1`)
    assert root_facts("tsad_exit2_np4_r1_logfmt") == ("python.logged_error", "python_exception", 1, 21, None)


def test_a_file_torch_load_misses_in_a_folder_named_for_its_data_is_a_missing_file():
    # `[1,3]<stderr>:[rank3]: FileNotFoundError: ... '/tmp/job_work/series/sensors_3.pt'` under torch.load
    assert root_facts("tsad_nofile_np4_r3_mpitag") == ("data.file_not_found", "python_exception", 3, 21,
                                                       "FileNotFoundError")


def test_the_same_file_in_a_checkpoint_folder_is_a_missing_checkpoint(tmp_path):
    report = edited_report("tsad_nofile_np4_r3_mpitag", "/tmp/job_work/series/", "/tmp/job_work/ckpt/", tmp_path)
    assert (report["root_cause"]["rule_id"], report["root_cause"]["category"]) == ("ckpt.not_found", "checkpoint")


@pytest.mark.parametrize(("slug", "rank"), [
    # bare bash loop: ranks 0 and 2 `Timed out waiting 12000ms`; rank 1, after `rank 1: threshold drifted,
    # rescanning full sensor history`, comes late and finds its peers gone (`Connection closed by peer`)
    ("tsad_rescan_np3_r1_bashloop", 1),
    # Open MPI's tags: rank 1's `user index stale, rebuilding user index` after every rank's step 1
    ("mf_late_np3_r1_mpitag", 1),
    # a user's `[rank N] ` labels, no step printed: every rank's `rank N/4 up, ...` but rank 1's
    # `rank 1: filterbank cache stale, recomputing`
    ("wav_slowcache_np4_r1_ranklabel", 1),
])
def test_with_no_agent_to_stop_it_the_late_rank_is_the_one_whose_last_words_went_elsewhere(slug, rank):
    assert root_facts(slug)[:3] == ("gloo.timeout", "collective_timeout", rank)


def test_output_that_stops_after_one_rank_went_on_alone_names_that_rank():
    # bash loop, `timeout` kills it silently: every rank's `rank N step 2 ...`, then rank 2's `tokenizer cache
    # miss, rebuilding subword table`
    assert verdict_and_root("ner_slowtok_np4_r2_bashloop") == ("hung", "hang.output_stopped", "hang", 2)


def test_rank_0s_closing_summary_after_every_ranks_same_result_is_a_finished_run():
    # a clean run under a bash loop: every rank's `rank N: local threshold 0.3365, global 0.3316, 7 anomalies`, then
    # rank 0's summary (`anomalies per sensor (all ranks): ...`); before stop 47 a hang that named no rank
    report = sample_report("tsad_none_np3_rnone_bashloop")
    assert (report["verdict"], report["root_cause"]) == ("ok", None)


def test_mp_spawns_report_of_a_child_killed_by_sigbus_names_the_child():
    # `torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated with signal SIGBUS`
    assert root_facts("ocr_sigbus_np3_r1_spawn")[:3] == ("signal.sigbus", "crash_signal", 1)


def test_bashs_job_notice_of_an_aborted_rank_is_the_signal():
    # `./loop.sh: line 18:  2611 Aborted   $PY fault196.py ...`: rank 0, the one rank with no traceback
    assert root_facts("ner_sigabrt_np3_r0_mpitag")[:3] == ("signal.sigabrt", "crash_signal", 0)
