"""A run whose ranks sum up after saying done, logging's error block cut off from its traceback by other ranks'
lines, a finite check of an expression, torch.save's stream failing under a file-size limit, and a program's own
line about a full disk: real CPU runs of torch 2.13 (sample_logs/cpu_adhoc, the 129th-133rd batches, each labelled
before triage ran; the test names the run)."""

from __future__ import annotations

import pytest

from sample_roots import edited_report, root_facts, sample_report


def test_ranks_that_sum_up_after_saying_done_finished():
    # every rank logs `trainer: done`, then `trainer: final val_loss 0.2204...`; torchrun prints nothing on success
    report = sample_report("trnr_none_np4_rnone_plain")
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
