"""A missing file torch.load was given that is one indexed piece of a data set (`flows_v2/flow_1.pt`), not a
checkpoint; a script's own check that counts the NaN values it found, raised as a ValueError or only printed; and
a logger record whose name carries the rank (`lmrk[2] ERROR ...`). Real CPU runs of torch 2.13 (sample_logs/cpu_adhoc,
the 222nd, 223rd, 325th and 331st batches, each labelled before triage ran)."""

from __future__ import annotations

import pytest

from logtriage.analysis.exceptions import _DATA_FILE
from sample_roots import edited_report, root_facts


def test_an_indexed_piece_of_data_torch_load_misses_is_a_missing_file():
    # `FileNotFoundError: ... '/tmp/job_work/flows_v2/flow_1.pt'` under torch.load on rank 1
    assert root_facts("oflow_noflow_np3_r1_tee")[:3] == ("data.file_not_found", "python_exception", 1)


@pytest.mark.parametrize(("path", "data"), [
    ("/tmp/job_work/flows_v2/flow_1.pt", True),
    ("/tmp/job_work/scans_v2/shard_003.pt", True),
    ("/tmp/job/ckpt/step-0003/rank3.pt", False),
    ("/tmp/job_work/del1/step_12.pt", False),
    ("/tmp/f50_ckpt/rank17/ema_step0150.pt", False),
    ("/tmp/job_work/best_ep0.pt", False),
    ("rng_state_3.pth", False),
    ("/tmp/job_work/netG_10.pth", False),
    # words joined before the number (243rd batch), a relative data folder (244th); a version is no index
    ("/tmp/job_work/sessions/clicks_part2.pt", True),
    ("data/conf_train_dedup_r2.pt", True),
    ("/tmp/job_work/hub/pretrained_v2.pt", False),
    ("/tmp/job_work/sessions/model_part2.pt", False),
    ("/tmp/job_work/metadata/ckpt_r2.pt", False),
])
def test_a_piece_is_told_from_a_checkpoint_by_its_name(path, data):
    assert (_DATA_FILE.search(f"No such file or directory: '{path}'") is not None) is data


def test_a_scripts_count_of_nan_values_is_numerical():
    # `ValueError: negative-sampling distribution has 64 NaN probabilities (popularity sum 0.0)` on rank 2
    assert root_facts("sess_negzero_np3_r2_prefix")[:3] == ("numerical.nonfinite_value", "numerical", 2)


def test_a_printed_count_of_non_finite_values_is_where_an_unseen_failure_began():
    # mp.spawn: rank 2 prints `rank 2: step 2: log-energy has 3 non-finite values (min energy 0)` and raises, its
    # traceback never reaches the console; spawn reports process 0's `Connection closed by peer`, a peer aborts
    assert root_facts("mfcc_nanlog_np3_r2_spawn")[:4] == ("numerical.nonfinite_count", "numerical", 2, 12)


def test_a_count_of_zero_non_finite_values_is_no_sign(tmp_path):
    # the same run had rank 2's check found nothing: no line names a rank, the diagnosis is not numerical
    rc = edited_report("mfcc_nanlog_np3_r2_spawn", "log-energy has 3 non-finite", "log-energy has 0 non-finite",
                       tmp_path)["root_cause"]
    assert rc["rule_id"] != "numerical.nonfinite_count" and rc["category"] != "numerical" and rc["rank"] is None


@pytest.mark.parametrize("slug, rank", [
    # `[rank2]: FloatingPointError: rank 2: log-mel has 22528 non-finite values (min power 0.0) in ...`
    ("wav_logzero_np3_r2_bashloop", 2),
    # `1: [rank1]: FloatingPointError: KAN output has 39/64 non-finite values at step 4 (grid 10 intervals)`
    ("kan_outgrid_np3_r1_srunlabel", 1),
])
def test_a_raised_floating_point_error_with_a_count_keeps_its_own_rule(slug, rank):
    assert root_facts(slug)[:3] == ("numerical.checked_nonfinite", "numerical", rank)


def test_a_logger_named_after_the_rank_logs_the_error_that_began_it():
    # `[default2|2]:2026-12-05 21:50:04,048 lmrk[2] ERROR rank 2: ERROR face detector found no face ...`, exit code 4;
    # ranks 0 and 1 log `training failed: RuntimeError: ... Connection closed by peer` two seconds later
    assert root_facts("lmrk_exit4_np3_r2_prefix")[:4] == ("python.logged_error", "python_exception", 2, 7)
