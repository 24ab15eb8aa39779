"""A run whose ranks sum up after saying done, logging's error block cut off from its traceback by other ranks'
lines, a finite check of an expression, torch.save's stream failing under a file-size limit, a program's own line
about a full disk or an unset variable, the rank whose late line names another size under gloo's abort, a restart
that never met again, and nodes labelled `[node1] `: real CPU runs of torch 2.13 (sample_logs/cpu_adhoc, the
129th-138th batches and earlier ones, each labelled before triage ran; the test names the run)."""

from __future__ import annotations

import pytest

from logtriage.api import triage
from sample_roots import SAMPLES, edited_report, root_facts, sample_report


@pytest.mark.parametrize("slug", [
    # every rank logs `trainer: done`, then `trainer: final val_loss 0.2204...`; torchrun prints nothing on success
    "trnr_none_np4_rnone_plain",
    # every rank's last line: `rank 2 done, best f1 0.7222`
    "evalm_none_np3_rnone_plain",
])
def test_ranks_that_sum_up_as_they_say_done_finished(slug):
    report = sample_report(slug)
    assert (report["verdict"], report["root_cause"]) == ("ok", None)


def test_a_rank_that_goes_on_to_wait_after_saying_done_has_not_finished(tmp_path):
    # the same run, rank 1's last line waiting instead of summing up: the output stops there
    report = edited_report("trnr_none_np4_rnone_plain", "[rank 1] trainer: final val_loss",
                           "[rank 1] trainer: waiting for val_loss", tmp_path)
    assert report["verdict"] == "hung"


def test_loggings_error_block_cut_off_from_its_traceback_is_not_a_failure():
    # `--- Logging error ---`, two other ranks' records, then the handler's traceback (KeyError: 'rank'), `Call
    # stack:`, `Message: ` and `Arguments: `; the run goes on and every rank says done
    report = sample_report("trnr_logfilter_np4_r2_plain")
    assert (report["verdict"], report["root_cause"]) == ("ok", None)


def test_the_same_traceback_without_loggings_header_is_a_failure(tmp_path):
    report = edited_report("trnr_logfilter_np4_r2_plain", "--- Logging error ---", "--- metrics ---", tmp_path)
    assert report["verdict"] == "failed"
    assert report["root_cause"]["exception_type"] in ("KeyError", "ValueError")


def test_a_finite_check_of_an_expression_is_numerical():
    # `FloatingPointError: noise schedule cosine: sqrt(1/alphas_cumprod) is not finite from t=999 (...)`
    assert root_facts("dfsn_cosine_np3_r1_tee") == (
        "numerical.checked_nonfinite", "numerical", 1, 13, "FloatingPointError")


def test_fairseqs_inconsistent_gradients_stay_a_nan_grad_norm():
    # `FloatingPointError: Fatal error: gradients are inconsistent between workers`, every worker's grad norm nan
    log = SAMPLES.parent / "public26" / "fairseq1372_mpspawn_process3_grad_norm_nan_on_all_eight_ranks_inconsistent_workers.log"
    assert triage([str(log)]).to_dict()["root_cause"]["rule_id"] == "numerical.grad_norm_nan"


@pytest.mark.parametrize("slug, rank, line", [
    # RLIMIT_FSIZE: torch.save's write_record raises `RuntimeError: basic_ios::clear: iostream error`, then its
    # __exit__ `[enforce fail at inline_container.cc:672] . unexpected pos 6016 vs 5908`
    ("rlim_fsize_np3_r1_prefix", 1, 44),
    ("rlim_fsize_np4_r3_plain", 3, 56),
])
def test_torch_saves_stream_failing_is_a_failed_checkpoint_write(slug, rank, line):
    assert root_facts(slug) == ("ckpt.write_failed", "checkpoint", rank, line, "RuntimeError")


@pytest.mark.parametrize("slug, rank, line", [
    # `rank 2: error: disk full: cannot write .../ema_snapshot.pt (1 MB needed, 0 MB free)`, then sys.exit(2)
    ("dfsn_diskfull_np3_r2_tee", 2, 29),
    ("dfsn_diskfull_np4_r1_pymodule", 1, 38),
])
def test_a_programs_own_error_about_a_full_disk_is_the_file_system(slug, rank, line):
    assert root_facts(slug) == ("host.filesystem_error", "environment", rank, line, None)


def test_a_programs_own_line_about_an_unset_variable_is_the_environment():
    # `noisy: scratch directory not configured on vm (NOISY_SCRATCH is unset), rank 2`, then sys.exit(1), among
    # 30-line config dumps, warnings and progress bars
    assert root_facts("noisy_env_np5_r2_loglevel") == ("env.program_variable_unset", "environment", 2, 152, None)


@pytest.mark.parametrize("slug, rank, line", [
    # rank 1 aborts (`120 vs 96`); rank 2's last line says `batch 10` where every other rank's says `batch 8`,
    # and rank 3's same line comes after the abort (its output was late)
    ("curr_schedmis_np4_r2_tee", 2, 36),
    # the ranks that early-stopped say `wait 2`, rank 1 `wait 1` (an earlier known miss)
    ("estop_patreset_np5_r1_tee_trainer", 1, 96),
])
def test_gloos_size_abort_moves_to_the_rank_whose_late_line_names_another_size(slug, rank, line):
    assert root_facts(slug) == ("gloo.size_mismatch", "collective_mismatch", rank, line, "gloo::EnforceNotMet")


def test_a_restart_that_times_out_in_ddps_constructor_is_the_echo_of_the_first_attempt():
    # attempt 0: rank 1 exits -11 (`failed (exitcode: -11) local_rank: 1`); the restarted rank 0 times out in
    # _verify_param_shape_across_processes: the restarted group never met again
    assert root_facts("evalm_segv_np3_r1_restart") == ("signal.sigsegv", "crash_signal", 1, 55, None)


def test_a_restart_that_stalls_after_its_steps_is_its_own_failure():
    # attempt 1 trains to step 3, where rank 3 sleeps and the others time out in DDP's all-reduce: labelled by it
    assert root_facts("hang_after_exc_np4_r3_plain")[:3] == ("gloo.timeout", "collective_timeout", 3)


def test_a_nodes_bracket_label_is_a_host_not_a_rank():
    # `[node1] [rank3]: ...`: torch's own rank label after `[node1] ` names other numbers; node 1's summary says
    # `rank : 3 (local_rank: 1)` `exitcode : -11`, so its agent's `local_rank: 1` is global rank 3
    assert root_facts("twon_segv_np4_r3_pdsh2")[:3] == ("signal.sigsegv", "crash_signal", 3)


@pytest.mark.parametrize("slug, rank", [
    # `rank 1: preemption notice received from the node, stopping inference at step 3`, then the rank's own
    # SIGTERM (a -15 the agent never sent)
    ("binf_preempt_np3_r1_plain", 1),
    ("binf_preempt_np3_r2_restart", 2),
])
def test_a_ranks_own_preemption_notice_is_an_external_stop(slug, rank):
    assert root_facts(slug) == ("signal.stop_notice", "external_stop", rank, 21, None)


@pytest.mark.parametrize("slug, rank, line", [
    # `PermissionError: [Errno 13] Permission denied: '/sys/fs/preds_rank3.jsonl'`: a path the program chose
    ("binf_perm_np4_r3_plain", 3, 31),
    # a logging FileHandler on an unwritable path (an earlier known miss)
    ("log_handler_np4_r3_prefix", 3, 19),
])
def test_a_permission_error_outside_checkpoint_code_is_the_programs(slug, rank, line):
    assert root_facts(slug) == ("python.exception", "python_exception", rank, line, "PermissionError")


def test_a_permission_error_in_a_checkpoints_save_stays_a_failed_write():
    assert root_facts("end_save_perm_np5_r0_tee")[:3] == ("ckpt.write_failed", "checkpoint", 0)


def test_the_one_rank_that_last_said_it_stopped_early_is_where_a_stopped_job_hung():
    # `rank 1 early stop after trial 1: loss 0.6601`, then silence until `timeout 60` stopped torchrun; ranks 0
    # and 2 waited in trial 2's DDP constructor
    report = sample_report("sweep_skip_np3_r1_tee_trainer")
    rc = report["root_cause"]
    assert (report["verdict"], rc["rule_id"], rc["category"], rc["rank"]) == (
        "hung", "hang.stopped_while_waiting", "hang", 1)


def test_agents_waiting_in_their_own_rendezvous_keys_is_a_rendezvous_failure():
    # node 0 trained alone to step 31; a second agent arrived, node 0 stopped its workers to re-form, and both
    # agents' `next_rendezvous` timed out on `/torch.rendezvous.none.1/MASTER_ADDR`: progress printed before is
    # the old group's, not a collective's wait
    rc = sample_report("elas_late_np4_rnone_pdsh2")["root_cause"]
    assert (rc["rule_id"], rc["category"]) == ("dist.store_wait_timeout", "rendezvous")


def test_a_missing_token_cache_saved_with_torch_save_is_a_missing_file():
    # `No such file or directory: '/tmp/job_work/once1_tokens.pt'`, read by torch.load before rank 0 built it
    assert root_facts("elas_once_np4_r2_restart") == (
        "data.file_not_found", "python_exception", 2, 24, "FileNotFoundError")


def test_the_summarys_exit_of_a_restarted_attempt_is_not_a_silent_first_death():
    # attempt 0: rank 1 aborts (`failed (exitcode: -6) local_rank: 1`); the restart dies in connectFullMesh and
    # the final summary lists rank 2's exit 1, from the restarted attempt, not a rank that died first unheard
    assert root_facts("swa_abort_np3_r1_restart") == ("signal.sigabrt", "crash_signal", 1, 48, None)


@pytest.mark.parametrize("slug, rank, line", [
    # `ValueError: rank 3: SWA learning rate must be positive and finite, got inf`
    ("swa_swalr_np4_r3_filter", 3, 12),
    ("swa_swalr_np3_r2_tee_trainer", 2, 25),
])
def test_a_validation_that_got_a_non_finite_value_is_numerical(slug, rank, line):
    assert root_facts(slug) == ("numerical.nonfinite_value", "numerical", rank, line, "ValueError")


def test_a_missing_data_case_saved_with_torch_save_is_a_missing_file():
    # `No such file or directory: '/tmp/job_work/miss1_case_3_3.pt'`: a volume of the dataset, not a checkpoint
    assert root_facts("vol3d_missing_np4_r3_filter")[:3] == ("data.file_not_found", "python_exception", 3)


def test_a_missing_replay_buffer_saved_with_torch_save_is_a_missing_file():
    # `No such file or directory: '/tmp/job_work/prev_run/replay_rank3_task0.pt'`: a replay buffer, data
    assert root_facts("cont_replaymiss_np4_r3_filter")[:3] == ("data.file_not_found", "python_exception", 3)
