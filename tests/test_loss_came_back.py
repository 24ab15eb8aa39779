"""A NaN loss that the same rank's later steps show finite again is one the run went on from: a
`transformers.Trainer` callback printed `loss nan` at step 0, before any loss was computed, and then finite losses
(cpu_adhoc 558th batch, real CPU runs under torchrun and accelerate). Only a later step counts: --tee prints a
rank's buffered stdout, earlier steps included, after the error it died of."""

from __future__ import annotations

import re

from sample_roots import SAMPLES, root_facts, verdict_and_root
from logtriage.api import triage

CONTROL = "sedge_none_np3_rnone_hf"


def test_a_control_run_whose_first_step_printed_a_nan_loss_is_ok():
    text = (SAMPLES / f"{CONTROL}.log").read_text()
    assert "rank 1 step 0 loss nan" in text and "rank 1 step 1 loss 3.9134552478790283" in text
    assert triage([str(SAMPLES / f"{CONTROL}.log")]).to_dict()["verdict"] == "ok"


def test_the_program_s_own_error_is_the_root_not_the_first_step_s_nan():
    # rank 0's callback: 'ERROR rank 0: chamber flux out of plausible range at step 3; stopping', then exit 4
    assert verdict_and_root("sedge_exit4_np3_r0_hf") == ("failed", "python.logged_error", "python_exception", 0)


def test_a_loss_that_stays_nan_is_the_error(tmp_path):
    text = (SAMPLES / f"{CONTROL}.log").read_text()
    stayed = re.sub(r"^(rank 1 step [1-5] loss )[0-9.]+", r"\1nan", text, flags=re.MULTILINE)
    assert stayed.count("rank 1 step") == 6 and stayed.count("loss nan") == 8
    log = tmp_path / "stayed.log"
    log.write_text(stayed)
    report = triage([str(log)]).to_dict()
    rc = report["root_cause"]
    assert (report["verdict"], rc["rule_id"], rc["rank"]) == ("failed", "numerical.loss_nan", 1)


def test_buffered_earlier_steps_after_the_error_are_no_sign():
    # --tee: rank 4's FloatingPointError comes first, its stdout (earlier steps, finite losses) after it
    assert root_facts("harp_nan_np5_r4_tee")[:3] == ("numerical.checked_nonfinite", "numerical", 4)
