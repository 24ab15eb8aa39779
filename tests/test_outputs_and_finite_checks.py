"""A program's outputs saved with torch.save into a folder that is not there, and a script's own finite check
raised as FloatingPointError whatever it names: real CPU runs of torch 2.13 (sample_logs/cpu_adhoc, the
150th-154th batches and earlier ones, each labelled before triage ran; the test names the run)."""

from __future__ import annotations

import pytest

from sample_roots import edited_report, root_facts


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
