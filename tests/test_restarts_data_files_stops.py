"""Restarts that cannot form the group again, data files saved like checkpoints, a loader's key read from a
checkpoint, a finite check worded value-first, the one rank left behind or still at work when a time limit
stopped the job, a program's own check for a missing library, and the rank that sent gloo a message of another
size: real CPU runs of torch 2.13 (sample_logs/cpu_adhoc, the 114th-123rd batches and earlier ones, each
labelled before triage ran; the test names the run)."""

from __future__ import annotations

import pytest

from sample_roots import edited_report, root_cause, root_facts, sample_report, verdict_and_root


@pytest.mark.parametrize("slug, rank, line", [
    # attempt 0: rank 3 exits 3 with no message; torchrun restarts the workers, whose init_process_group fails
    # in `Gloo connectFullMesh failed ... Connection refused` before they print a prefixed line, then the agent
    # reports the restarted rank 0's exit 1: both are the restart's echo of rank 3's exit
    ("launchm_exit3_np4_r3_restart", 3, 52),
    ("exit255_np4_r2_restart", 2, 46),
])
def test_a_restart_that_cannot_connect_again_is_the_echo_of_the_first_attempts_failure(slug, rank, line):
    assert root_facts(slug) == ("signal.exit_nonzero", "unknown", rank, line, None)


def test_a_logged_error_keeps_the_root_over_the_restarted_ranks_own_later_error():
    # attempt 0: rank 1 logs `[rank=1] ERROR rank 1: ERROR crop 13 of shard 1 has 0 visible pedestrians ...` and
    # exits 4; the restarted rank 1's connectFullMesh is refused. The record yields to a later error of its own
    # rank only within its attempt (351st batch)
    assert root_facts("pdet_exit4_np3_r1_restart")[:4] == ("python.logged_error", "python_exception", 1, 14)


def test_a_first_start_that_cannot_connect_is_still_the_root():
    # the ranks' connectFullMesh is refused at the first start (a stale file store): no agent report before it
    assert root_facts("hinit_file_stale_np4_rall_plain")[:2] == ("gloo.connect_full_mesh", "rendezvous")


def test_a_key_missing_from_a_loaded_checkpoint_is_the_checkpoints():
    # `opt.load_state_dict(shard["optimizer"])` -> `KeyError: 'optimizer'`: the innermost frame's line hands the
    # loaded file's entry to load_state_dict, so the file is not in the format the loader expects
    assert root_facts("launchm_resume_np6_r4_pymodule") == ("ckpt.format_mismatch", "checkpoint", 4, 13, "KeyError")


@pytest.mark.parametrize("slug, rank", [
    # torch.load of `.../data/shard_00003.pt`, a data shard the preprocessing skipped
    ("launchm_shard_np6_r3_filter", 3),
    ("launchm_shard_np4_r1_loglevel", 1),
    # a graph partition `part_3.pt`
    ("gnn_missing_np4_r3_plain", 3),
])
def test_a_missing_data_file_saved_with_torch_save_is_not_a_checkpoint(slug, rank):
    rc = root_cause(slug)
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["exception_type"]) == (
        "data.file_not_found", "python_exception", rank, "FileNotFoundError")


def test_a_missing_file_named_for_checkpoints_stays_a_checkpoint(tmp_path):
    # the same run, its shard renamed into a checkpoint folder: a checkpoint not found again
    rc = edited_report("launchm_shard_np6_r3_filter", "/data/shard_00003.pt", "/data/ckpt/shard_00003.pt",
                       tmp_path)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("ckpt.not_found", "checkpoint", 3)


@pytest.mark.parametrize("slug, rank, line", [
    # `FloatingPointError: non-finite embeddings on rank 2 at epoch 0 step 4: 1 of 6 rows`
    ("contra_zeronorm_np4_r2_tee_trainer", 2, 45),
    ("contra_zeronorm_np5_r3_filter", 3, 28),
])
def test_a_finite_check_that_names_the_value_first_is_numerical(slug, rank, line):
    assert root_facts(slug) == ("numerical.checked_nonfinite", "numerical", rank, line, "FloatingPointError")


def test_the_one_rank_that_did_not_go_on_to_the_others_next_line_is_where_a_stopped_job_hung():
    # `timeout 60` stops torchrun 50 s after its start; ranks 0 and 2 printed `rank R eval: 4 images, 8
    # detections after NMS` after their step 7, rank 1's last line is its step 7 (stuck in its NMS loop)
    assert verdict_and_root("det_evalhang_np3_r1_plain") == ("hung", "hang.stopped_while_waiting", "hang", 1)


def test_ranks_that_all_went_on_alike_name_no_rank(tmp_path):
    # the same run with rank 1's eval line put back: every rank's last line is the same message, and nothing
    # says which rank the others waited for (the stop still ends a hang: no rank printed after it)
    line = "rank 2 eval: 4 images, 9 detections after NMS\n"
    report = edited_report("det_evalhang_np3_r1_plain", line, line + line.replace("rank 2", "rank 1"), tmp_path)
    assert (report["verdict"], report["root_cause"]["rule_id"], report["root_cause"]["rank"]) == (
        "hung", "hang.stopped_while_waiting", None)


@pytest.mark.parametrize("slug, rank, line", [
    # no rank printed a step; rank 2 alone printed anything (`rank 2: loading warm-start tables from ... (1.3 GB)
    # ...`) of the three workers the agent stopped
    ("rec_slowtable_np3_r2_plain", 2, 6),
    # every rank printed its start-up lines; rank 2 went on (`recomputing the teacher logits`, `teacher logits
    # 32/96`) after the others fell silent
    ("distill_cacheslow_np3_r2_plain", 2, 19),
    # rank 1 alone says it waits (`waiting for /tmp/job_work/data/part-0001.csv (40s)`), the others print nothing
    ("fcst_waitcsv_np3_r1_tee", 1, 10),
])
def test_the_one_rank_still_at_work_in_a_stopped_start_up_is_where_the_others_waited(slug, rank, line):
    report = sample_report(slug)
    rc = report["root_cause"]
    assert (report["verdict"], rc["rule_id"], rc["rank"], rc["line"]) == ("hung", "hang.stopped_while_waiting", rank, line)


def test_rank_0_alone_speaking_in_a_stopped_start_up_names_no_rank(tmp_path):
    # the same run with the line said by rank 0: a program that logs on rank 0 only says nothing of the others
    report = edited_report("rec_slowtable_np3_r2_plain", "rank 2: loading warm-start tables",
                           "rank 0: loading warm-start tables", tmp_path)
    assert (report["verdict"], report["root_cause"]["rank"]) == ("hung", None)


@pytest.mark.parametrize("slug, rank", [("asr_nosox_np4_r0_plain", 0), ("asr_nosox_np5_r3_prefix", 3)])
def test_a_programs_own_error_naming_a_missing_library_is_the_environments(slug, rank):
    # `ERROR: rank 0: audio backend 'sox_io' is not available on this node (libsox.so.3: cannot open shared
    # object file: No such file or directory); ...`, then exit 3 and no traceback
    assert root_facts(slug) == ("env.program_library_missing", "environment", rank, 5, None)


@pytest.mark.parametrize("slug, rank, line", [
    # `rank 1 eval: 128 reals, 128 fakes, 10-dim features` where every other rank says 6-dim; gloo aborts rank 0
    ("gan_fidshape_np4_r1_plain", 1, 64),
    ("surg_headwidth_np5_r2_plain", 2, 31),
    ("eval_uneven_np4_r3_plain", 3, 22),
    ("estop_patreset_np4_r2_plain", 2, 78),
])
def test_the_rank_whose_last_line_says_another_size_sent_the_message_gloo_aborted_on(slug, rank, line):
    assert root_facts(slug) == ("gloo.size_mismatch", "collective_mismatch", rank, line, "gloo::EnforceNotMet")


def test_last_lines_alike_leave_gloos_abort_on_the_receiver(tmp_path):
    rc = edited_report("gan_fidshape_np4_r1_plain", "128 fakes, 10-dim features", "128 fakes, 6-dim features",
                       tmp_path)["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("gloo.size_mismatch", 0)


def test_a_rank_the_monitored_barrier_names_that_aborted_on_gloos_size_check_is_a_mismatch():
    # DETAIL: rank 0's monitoredBarrier names rank 3, which died of SIGABRT after gloo's unprefixed `op.preamble
    # .length <= op.nbytes. 1024 vs 512. Received data size doesn't match expected size`
    assert root_facts("rec_splits_np5_r3_detail") == ("gloo.size_mismatch", "collective_mismatch", 3, 11, "gloo::EnforceNotMet")


@pytest.mark.parametrize("slug", ["lrs_stall_np3_r1_tee", "lm_valhang_np3_r1_tee"])
def test_a_sigterm_to_the_launcher_after_every_rank_went_silent_ends_a_hang(slug):
    # `timeout 60`: every rank's last line is its progress at one step, nothing failed, and no rank printed after
    # `Received 15 death signal`; which rank stalled the log does not say
    assert verdict_and_root(slug) == ("hung", "hang.stopped_while_waiting", "hang", None)


def test_workers_that_answer_the_sigterm_were_alive_and_the_stop_is_external():
    # kill -TERM to torchrun during step 9: every rank's handler prints `SIGTERM received (preemption)` and
    # finishes step 9 after the agent's stop line
    assert verdict_and_root("preempt_agentterm_np4_rnone_plain") == (
        "failed", "launcher.signal_exception", "external_stop", None)


def test_a_hand_made_launchers_rank_label_before_torchs_own_prefix_is_stripped():
    # `sed -u "s/^/[rank $R] /"` in front of `[rank2]: Traceback ...`: the traceback is read, KeyError on rank 2
    assert root_facts("handl_keyerr_np4_r2_bashsed") == ("python.exception", "python_exception", 2, 15, "KeyError")


def test_a_rank_label_alone_stays_in_the_text():
    from logtriage.demux.prefixes import Dialect, strip_prefixes
    plain = Dialect()
    stacked = strip_prefixes("[rank 2] [rank2]: KeyError: 'warmup'", plain)
    assert (stacked.text, stacked.rank) == ("KeyError: 'warmup'", 2)
    alone = strip_prefixes("[rank 2] step 3 loss 1.0", plain)
    assert alone.text == "[rank 2] step 3 loss 1.0"


def test_a_supervisors_report_of_a_ranks_exit_code_names_the_rank():
    # a Popen supervisor: `[launcher] rank 3 exited with code 3` after ranks 2 and 4 lost their peer
    assert root_facts("handl_exit3_np5_r3_popen") == ("signal.exit_nonzero", "unknown", 3, 50, None)


def test_a_missing_training_shard_is_data():
    # torch.load of `.../shards/train_00004.pt`
    rc = root_cause("vit_noshard_np5_r4_tee")
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("data.file_not_found", "python_exception", 4)


def test_a_restart_whose_one_worker_timed_out_before_any_progress_failed_of_the_first_attempts_signal():
    # attempt 0: rank 1 dies of SIGBUS (`failed (exitcode: -7) local_rank: 1`, no line of its own); attempt 1: rank 1
    # prints its start-up line and times out in its first barrier, the others never back (226th batch)
    assert root_facts("wxg_sigbus_np3_r1_restart")[:3] == ("signal.sigbus", "crash_signal", 1)
