"""A run whose ranks sum up after saying done, logging's error block cut off from its traceback by other ranks'
lines, a finite check of an expression, torch.save's stream failing under a file-size limit, a program's own line
about a full disk or an unset variable, the rank whose late line names another size under gloo's abort, a restart
that never met again, and nodes labelled `[node1] `: real CPU runs of torch 2.13 (sample_logs/cpu_adhoc, the
129th-138th batches and earlier ones, each labelled before triage ran; the test names the run)."""

from __future__ import annotations

import pytest

from sample_roots import edited_report, root_facts, sample_report


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
    from logtriage.api import triage
    from sample_roots import SAMPLES
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
    assert root_facts(slug) == ("gloo.size_mismatch", "collective_mismatch", rank, line, None)


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
