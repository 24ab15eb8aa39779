"""Job scripts around torchrun and what they do to the console: a retry loop that starts torchrun again,
a `timeout` that ends a hung job, a script's own ERROR print, buffered output, a rank that left early,
and a Megatron-style layout check (real CPU runs of torch 2.13 in sample_logs/cpu_adhoc, the 51st-53rd
batches, each labelled before triage ran; the test names the run)."""

from __future__ import annotations

import pytest

from logtriage.demux.line_marks import find_rank_marker

from sample_roots import sample_report as _report


def _root(report: dict) -> tuple:
    rc = report["root_cause"]
    return report["verdict"], rc["rule_id"], rc["category"], rc["rank"], rc["line"]


def test_a_retry_that_finished_makes_the_first_launchs_failure_a_recovered_one():
    # wrap_ok_np4_rnone_retry: attempt 1 rank 1 SIGSEGV and its summary; the wrapper starts torchrun
    # again (a new launcher pid, line 87) and every rank finishes
    report = _report("wrap_ok_np4_rnone_retry")
    assert report["verdict"] == "ok" and report["root_cause"] is None
    assert any("torchrun was started again" in note and "line 51" in note for note in report["notes"])


def test_a_retry_loop_is_judged_by_its_last_launch():
    # wrap_retrynan_np4_r2_retry: three launches, three different failures; the job ends on the third,
    # rank 2's NaN loss (the first traceback in the file is the first launch's ValueError on rank 1)
    assert _root(_report("wrap_retrynan_np4_r2_retry")) == ("failed", "numerical.checked_nonfinite", "numerical", 2, 276)


@pytest.mark.parametrize("slug, rank, line", [
    ("wrap_hang_np4_r1_timeout", 1, 55),     # plain: rank 1's "fetching batch 3" is the one line after step 2
    ("wrap_hang_np5_r0_timeout", 0, 59),     # --tee 3: the workers' lines come after the death-signal lines
])
def test_a_time_limit_that_stopped_the_launcher_ended_a_hang(slug, rank, line):
    assert _root(_report(slug)) == ("hung", "hang.command_timeout", "hang", rank, line)


def test_a_rank_that_returned_early_is_the_one_its_peers_lost_though_one_peer_timed_out():
    # buf_early_np4_r3_plain: rank 3 ran out of batches and exited 0; ranks 0 and 2 lost their
    # connection to it and rank 1 waited out the 15 s timeout
    assert _root(_report("buf_early_np4_r3_plain")) == ("failed", "gloo.connection_closed", "collective_error",
                                                        3, 33)


def test_a_scripts_own_error_print_before_a_quiet_exit_is_the_root():
    # buf_errprint_np6_r5_plain: `ERROR rank 5: shard 0005 checksum mismatch ...` then sys.exit(1)
    assert _root(_report("buf_errprint_np6_r5_plain")) == ("failed", "python.logged_error", "python_exception",
                                                           5, 20)


def test_a_level_word_before_the_rank_names_it():
    assert find_rank_marker("ERROR rank 5: shard 0005 checksum mismatch at step 3, stopping") == 5
    assert find_rank_marker("INFO rank 2: step 3 loss 0.41") == 2
    # behind the level and the logger's name (`%(asctime)s %(levelname)s %(name)s: %(message)s`, vqv_kmeans)
    assert find_rank_marker("2026-12-05 15:39:51,756 INFO vqvae: rank 2: re-initialising dead codes with k-means") == 2
    assert find_rank_marker("INFO vqvae: ranks 2: x") is None and find_rank_marker("foo: rank 2: x") is None
    assert find_rank_marker("the rank 2: step 3") is None


def test_megatrons_divisibility_check_is_a_layout_that_does_not_fit_the_launch():
    # mp_config_np6_rall_plain: 6 ranks for tensor 2 x pipeline 2, on every rank
    verdict, rule, category, _, _ = _root(_report("mp_config_np6_rall_plain"))
    assert (verdict, rule, category) == ("failed", "dist.mesh_layout", "launch_usage")
