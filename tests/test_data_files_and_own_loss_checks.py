"""Two rule names as the labellers of the real CPU runs give them (sample_logs/cpu_adhoc, every log labelled by
hand before triage ran):

- a missing file that is data by its name (a shard, a split, a file in a folder of data) is
  data.file_not_found, the catalog's rule titled "A data file ... does not exist", not the generic
  python.file_not_found; a missing vocabulary or schedule stays generic, a checkpoint's path stays
  ckpt.not_found (labels: 226 data to 94 generic for such files over the batches before stop 54, 45 to 2
  in stop 53's);
- a FloatingPointError the program raised over its own loss (`raise FloatingPointError("non-finite loss on
  rank 1 at step 3")`) is numerical.checked_nonfinite, "the script's own finiteness check", whichever
  value it checked (labels 283 to 70); a framework's check of the loss, raised in site-packages
  (detectron2's `_detect_anomaly`), stays numerical.loss_nan."""

from __future__ import annotations

from pathlib import Path

import pytest

from logtriage.api import triage
from sample_roots import edited_report, root_facts

PUBLIC3 = Path(__file__).resolve().parent.parent / "sample_logs" / "public3"


@pytest.mark.parametrize("slug, rank, line", [
    ("glac_notiles_np4_r3_wrapper", 3, 29),          # '/tmp/job_work/sar/asc/tiles_3.pt', read by torch.load
])
def test_a_missing_data_piece_is_the_data_rule(slug, rank, line):
    assert root_facts(slug)[:4] == ("data.file_not_found", "python_exception", rank, line)


@pytest.mark.parametrize("slug, rule", [
    ("sbert_vocab_np3_r1_loglevel", "python.file_not_found"),     # a vocabulary file: not data by its name
    ("dae_schedfile_np3_r2_wrapper", "python.file_not_found"),    # a noise schedule's YAML
    ("adv_ckptmissing_np4_r1_wrapper", "ckpt.not_found"),         # a checkpoint's path
])
def test_other_missing_files_keep_their_rules(slug, rule):
    assert root_facts(slug)[0] == rule


def test_a_data_piece_renamed_as_a_checkpoint_is_the_checkpoints(tmp_path):
    report = edited_report("glac_notiles_np4_r3_wrapper", "/tmp/job_work/sar/asc/tiles_3.pt",
                           "/tmp/job_work/checkpoints/step_3.pt", tmp_path)
    assert report["root_cause"]["rule_id"] == "ckpt.not_found"
    assert report["root_cause"]["rank"] == 3


def test_a_printed_nan_loss_then_the_programs_raise_is_its_own_check():
    # line 59 `rank 1: loss is nan at step 3; ...`, then rank 1's `FloatingPointError: non-finite loss ...`
    assert root_facts("agri_cloudnan_np3_r1_loglevel") == (
        "numerical.checked_nonfinite", "numerical", 1, 59, "FloatingPointError")


def test_a_frameworks_loss_check_stays_the_losss():
    report = triage([str(PUBLIC3 / "centermask2_mpspawn_process1_loss_nan_floatingpointerror.log")]).to_dict()
    assert report["root_cause"]["rule_id"] == "numerical.loss_nan"
    assert report["root_cause"]["exception_type"] == "FloatingPointError"


def test_the_same_raise_in_an_installed_package_stays_the_losss(tmp_path):
    report = edited_report("agri_cloudnan_np3_r1_loglevel", '"/tmp/job/fault326.py"',
                           '"/usr/lib/python3/dist-packages/trainer/loop.py"', tmp_path)
    assert report["root_cause"]["rule_id"] == "numerical.loss_nan"
    assert report["root_cause"]["rank"] == 1


def test_the_raise_is_found_past_a_long_framework_traceback():
    # line 55 `rank 4: loss is nan at step 3, ...`, then a 110-line Lightning traceback ending in rank 4's own
    # `raise FloatingPointError(...)` (line 167)
    assert root_facts("lyric_nanloss_np6_r4_pltorchrun")[:4] == ("numerical.checked_nonfinite", "numerical", 4, 55)


def test_another_exception_raised_over_the_loss_is_no_finite_check(tmp_path):
    report = edited_report("lyric_nanloss_np6_r4_pltorchrun", "FloatingPointError", "RuntimeError", tmp_path)
    assert (report["root_cause"]["rule_id"], report["root_cause"]["rank"]) == ("numerical.loss_nan", 4)
