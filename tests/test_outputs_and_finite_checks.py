"""A program's outputs saved with torch.save into a folder that is not there, a script's own finite check
raised as FloatingPointError whatever it names, a restart that never met again before any progress, a rank's
own lower-case error line, gloo's check of an all_gather's buffers, an optimizer state saved for other
parameter groups, a config's bound read as a report field, data shards named by split or number, the rank a
line's own label names before a count per rank, and the rank whose last line names the next step in words no
other rank printed: real CPU runs of torch 2.13 (sample_logs/cpu_adhoc, the 150th-169th batches and earlier
ones, each labelled before triage ran; the test names the run)."""

from __future__ import annotations

import pytest

from sample_roots import edited_report, root_facts, sample_report


@pytest.mark.parametrize(("slug", "rank", "line"), [
    # `write_samples` -> torch.save(imgs, ".../samples_rank2/step0_rank2.pt"):
    # `RuntimeError: Parent directory /tmp/job_work/samples_rank2 does not exist.`
    ("vae_samples_np3_r2_wrapper", 2, 26),
    ("vae_samples_np4_r1_filter", 1, 22),
])
def test_samples_saved_into_a_missing_folder_are_the_programs_error_not_a_checkpoints(slug, rank, line):
    assert root_facts(slug) == ("python.exception", "python_exception", rank, line, "RuntimeError")


def test_a_checkpoint_saved_into_a_missing_folder_is_still_a_failed_checkpoint_write(tmp_path):
    # the same run, the folder named for checkpoints: torch.save's failure is the checkpoint's
    report = edited_report("vae_samples_np3_r2_wrapper", "samples_rank2", "ckpt_rank2", tmp_path)
    rc = report["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("ckpt.write_failed", "checkpoint", 2)


@pytest.mark.parametrize(("slug", "rank", "line"), [
    # `FloatingPointError: non-finite activations at step 3 micro 0: 32 values`
    ("actck_nan_np3_r1_detail", 1, 22),
    # `FloatingPointError: non-finite logits in batch 16-24 ...`
    ("binf_nan_np4_r3_tee", 3, 28),
])
def test_a_scripts_floating_point_error_is_its_own_finite_check_whatever_it_names(slug, rank, line):
    assert root_facts(slug) == ("numerical.checked_nonfinite", "numerical", rank, line, "FloatingPointError")


def test_a_restart_whose_group_timed_out_before_any_progress_failed_of_the_first_attempts_error():
    # attempt 0: rank 1 `FileNotFoundError: ... part-00001-of-00003.tsv`; the restarted attempt's rank 2 times out in
    # the start-up barrier (gloo recv 12000ms) before any rank prints a step, and no restart line is printed
    assert root_facts("kge_tripfile_np3_r1_restart") == ("python.file_not_found", "python_exception", 1, 9,
                                                         "FileNotFoundError")


def test_a_restart_that_made_progress_fails_of_its_own_timeout():
    # attempt 0: rank 0's ValueError; attempt 1 trains (`attempt 1 rank 0 step 1 ...`, lines no rank prefix
    # claims) until rank 3 sleeps and the others time out: the run ended on that stall
    assert root_facts("hang_after_exc_np4_r3_plain")[:3] == ("gloo.timeout", "collective_timeout", 3)


def test_a_ranks_own_lower_case_error_line_before_its_exit_is_a_logged_error():
    # `worker-0: [rank 1] error: lr schedule invalid: ...`, then `failed (exitcode: 2) local_rank: 1`
    assert root_facts("lamb_lrexit_np4_r1_pdsh2") == ("python.logged_error", "python_exception", 1, 10, None)


@pytest.mark.parametrize(("slug", "rank", "line"), [
    # `RuntimeError: ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (33), got (32))`
    ("kge_evalgather_np4_r1_plain", 1, 42),
    ("kge_evalgather_np3_r2_prefix", 2, 32),
])
def test_gloos_check_of_an_all_gathers_buffers_is_a_collective_mismatch_on_the_odd_rank(slug, rank, line):
    assert root_facts(slug) == ("gloo.invalid_tensor_size", "collective_mismatch", rank, line, "RuntimeError")


def test_an_optimizer_state_saved_for_other_parameter_groups_is_an_optimizer_state_mismatch():
    # `ValueError: loaded state dict contains a parameter group that doesn't match the size of optimizer's group`
    assert root_facts("lamb_resume_np3_r1_wrapper") == ("ckpt.optimizer_state_mismatch", "checkpoint", 1, 19,
                                                        "ValueError")


def test_a_configs_short_bound_is_no_report_field():
    # `KeyError: 't_max'` from `cfg["t_max"]` on every rank: the program's exception, not error manual E004
    assert root_facts("pinn_key_np3_rall_prefix")[:2] == ("python.exception", "python_exception")


@pytest.mark.parametrize(("slug", "rank", "line"), [
    # torch.load of `/tmp/job_work/feats_v2/train-00002-of-00003.pt`: a split's shard of features
    ("ctc_featfile_np3_r2_tee_trainer", 2, 25),
    # torch.load of `/tmp/job_work/scans_v2/shard_003.pt`: a numbered data shard
    ("pcd_cloudfile_np4_r3_filter", 3, 18),
])
def test_a_missing_data_shard_loaded_with_torch_load_is_a_missing_data_file_not_a_checkpoint(slug, rank, line):
    assert root_facts(slug) == ("data.file_not_found", "python_exception", rank, line, "FileNotFoundError")


def test_the_rank_whose_last_line_names_the_next_step_in_its_own_words_is_the_one_the_others_waited_for():
    # every rank's last line is `rank N step 2 loss ... psnr ...` but rank 2's `rank 2 writing validation images for
    # step 3`; `timeout` then stops torchrun
    report = sample_report("sr_valwait_np4_r2_tee")
    rc = report["root_cause"]
    assert (report["verdict"], rc["rule_id"], rc["rank"]) == ("hung", "hang.stopped_while_waiting", 2)


def test_a_progress_line_every_rank_prints_is_still_progress():
    # `rank N step 5 grad-norm 2.777` on every rank (another shape than `step N loss ... lr ...`); ranks 0 and 1 went
    # on to `eval: 32 images`, rank 2 did not
    report = sample_report("vit_evalstall_np3_r2_tee")
    assert (report["verdict"], report["root_cause"]["rank"]) == ("hung", 2)


def test_a_count_per_rank_in_a_ranks_own_error_line_does_not_name_another_rank():
    # `ERROR rank 2: too few identities per rank: 1 < P=4 ...`, then `failed (exitcode: 2) local_rank: 2`
    assert root_facts("trip_fewids_np3_r2_loglevel") == ("python.logged_error", "python_exception", 2, 44, None)
