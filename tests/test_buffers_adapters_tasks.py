"""Model buffers synced across ranks, frozen layers and teacher models, and multi-task training, on real CPU
runs of torch 2.13 (sample_logs/cpu_adhoc, the 99th-101st batches, each labelled before triage ran; the
test names the run)."""

from __future__ import annotations

import pytest

from sample_roots import root_cause, verdict_and_root


def test_a_rank_still_printing_after_the_others_timed_out_came_late():
    # frz_teachercache_np8_r6_pdsh2: two nodes; six ranks time out in DDP's all_reduce at step 3, rank 0 loses
    # its peers before any timeout is printed, rank 6 prints `step 3 teacher cache 40 shards` below the
    # timeouts and then loses its peers: it read its teacher cache from slow storage
    assert verdict_and_root("frz_teachercache_np8_r6_pdsh2") == ("failed", "gloo.timeout", "collective_timeout", 6)
    assert "still printing its own progress after their timeouts" in " ".join(
        root_cause("frz_teachercache_np8_r6_pdsh2")["reasons"])


@pytest.mark.parametrize("slug, rank", [
    ("frz_teachercache_np4_r2_plain", 2),   # one rank missing from the timeouts: read as before
])
def test_the_one_rank_missing_from_the_timeouts_is_still_read_first(slug, rank):
    assert verdict_and_root(slug)[3] == rank


def test_a_size_abort_goes_to_the_rank_that_said_more_at_start_when_every_first_line_agrees():
    # bnorm_bufone_np4_r0_plain: every rank's first line lists the same buffers; rank 0 alone then says
    # `rank 0: DEBUG_ACT_HIST=1, registered act_hist buffer`, and DDP's broadcast from rank 0 aborts ranks 1 and 2
    # (`2080 vs 1440`, no prefix; torchrun's summary names rank 1)
    assert verdict_and_root("bnorm_bufone_np4_r0_plain") == ("failed", "gloo.size_mismatch", "collective_mismatch", 0)
    assert "DEBUG_ACT_HIST=1" in " ".join(root_cause("bnorm_bufone_np4_r0_plain")["reasons"])


@pytest.mark.parametrize("slug, expected", [
    # a buffer of another dtype or shape on one rank: the size abort's rank from its odd first line
    ("bnorm_bufdtype_np4_r1_plain", ("failed", "gloo.size_mismatch", "collective_mismatch", 1)),
    ("bnorm_bufshape_np5_r3_tee3", ("failed", "gloo.size_mismatch", "collective_mismatch", 3)),
    # SyncBatchNorm on CPU, on one rank
    ("bnorm_syncbn1_np5_r3_tee3", ("failed", "ddp.syncbn_usage", "ddp_usage", 3)),
    # adapters injected on one rank only: DDP's construction check
    ("frz_adapterrank_np5_r3_plain", ("failed", None, "ddp_usage", 3)),
    # one task's dataset exhausted first on one rank
    ("mtask_exhaust_np4_r1_tee3", ("failed", None, "python_exception", 1)),
])
def test_buffers_adapters_and_tasks_read_as_labelled(slug, expected):
    got = verdict_and_root(slug)
    assert (got[0], got[2], got[3]) == (expected[0], expected[2], expected[3])
    if expected[1]:
        assert got[1] == expected[1]


def test_an_outside_stop_after_one_rank_went_on_alone_is_a_hang_at_that_rank():
    # bnorm_pbnhang_np4_r2_hang: `timeout 40`, no error; ranks 0, 1, 3 end on `step 2 loss ...`, rank 2 on
    # `rank 2: recomputing precise BN statistics over 150 batches` (its prefetch queue ran dry), 39 s after the start
    assert verdict_and_root("bnorm_pbnhang_np4_r2_hang") == ("hung", "hang.stopped_while_waiting", "hang", 2)
    # mtask_rejectloop_np3_rall_hang: every rank's last line is its step-5 line: no rank went on alone, so no
    # rank is named (the SIGTERM still ends a hang: no rank printed after it, tests/test_restarts_data_files_stops.py)
    assert verdict_and_root("mtask_rejectloop_np3_rall_hang")[2:] == ("hang", None)


def test_an_earlier_size_abort_moves_to_the_rank_that_alone_loaded_weights():
    # pre_bcastshape_np4_r0_plain (84th batch): every rank's first line alike, rank 0's second `rank 0 loaded
    # pretrained weights from ...`; its broadcast of a wider head aborts ranks 1 and 2 (`640 vs 256`)
    assert verdict_and_root("pre_bcastshape_np4_r0_plain") == ("failed", "gloo.size_mismatch", "collective_mismatch", 0)


@pytest.mark.parametrize("slug, rank", [
    # every rank resumes; one loads a plain SGD state into the Adam-based ZeroRedundancyOptimizer, and Adam's
    # first step asks it for `exp_avg` (the others lose that rank in ZeRO's parameter broadcasts)
    ("zro_wrongtype_np4_r0_tee", 0),
    ("zro_wrongtype_np5_r3_loglevel", 3),
])
def test_an_optimizer_state_key_missing_at_step_is_another_optimizers_checkpoint(slug, rank):
    assert verdict_and_root(slug) == ("failed", "ckpt.optimizer_state_mismatch", "checkpoint", rank)


def test_adams_state_key_is_no_missing_report_field():
    from logtriage.catalog.loader import load_catalog
    from logtriage.catalog.matcher import match_line
    catalog = load_catalog()

    def rules(text: str) -> list[str]:
        return [h.rule.id for h in match_line(catalog, text)]
    assert rules("KeyError: 'exp_avg'")[0] == "ckpt.optimizer_state_mismatch"
    assert "report.missing_field" not in rules("KeyError: 'exp_avg'")
    assert "report.missing_field" in rules("KeyError: 'grad_norm_mean'")
    assert "report.missing_field" in rules("KeyError: 'top_avg'")


def test_zero_redundancy_optimizers_overlap_without_ddps_hook_is_a_ddp_usage_error_of_every_rank():
    # zro_overlap_np4_rall_plain: overlap_with_ddp=True and no hook_with_zero_step; step() only warns, then
    # consolidate_state_dict raises on all four ranks
    assert verdict_and_root("zro_overlap_np4_rall_plain")[:3] == ("failed", "ddp.reducer_usage", "ddp_usage")
    assert root_cause("zro_overlap_np4_rall_plain")["ranks"] == [0, 1, 2, 3]   # the same error on every rank


@pytest.mark.parametrize("slug, rank", [
    # every rank raises `loss is nan` after the advantage all_reduce; only one rank's rollout line said `reward inf`
    ("rlroll_logreward_np4_r3_plain", 3),
    ("rlroll_logreward_np5_r1_tee", 1),        # (--tee: its stdout line comes after the tracebacks)
    ("rlroll_lognocheck_np4_r0_plain", 0),     # (then every rank's `loss nan`: a name all ranks print non-finite)
])
def test_the_one_rank_that_printed_a_value_as_inf_started_a_shared_numerical_error(slug, rank):
    verdict, _, category, got = verdict_and_root(slug)
    assert (verdict, category, got) == ("failed", "numerical", rank)


def test_a_script_line_that_starts_with_rank_n_update_names_its_rank():
    from logtriage.demux.line_marks import find_rank_marker
    assert find_rank_marker("rank 3 update 1 rollout steps 48 episodes 2 reward inf") == 3
    assert find_rank_marker("ranking update 1") is None


def test_a_distributions_check_that_refused_finite_values_is_the_programs_error_not_a_nan():
    # rlroll_catneg_np4_r1_plain: Categorical(probs=...) with a negative entry, printed below the error as
    # `tensor([ 0.4234,  0.6182, -0.0416])`
    assert verdict_and_root("rlroll_catneg_np4_r1_plain") == ("failed", "python.exception", "python_exception", 1)
    # rlroll_nanobs_np4_r2_plain: the same check refusing `tensor([nan, nan, nan])` stays numerical
    assert verdict_and_root("rlroll_nanobs_np4_r2_plain") == ("failed", "numerical.nonfinite_value", "numerical", 2)
