"""A script's own error record with the level first and the rank in brackets after it: `ERROR [rank 2] currency
table mismatch: invoices in CHF but rates.json has no CHF entry; refusing to export`, then `sys.exit(2)` (real CPU
runs under `accelerate launch` 1.16.0, torch 2.13, sample_logs/cpu_adhoc batch 431, labelled before triage ran).
The rank's message is the diagnosis; the others' `Connection closed by peer` follows from it."""

from __future__ import annotations

from logtriage.api import triage
from sample_roots import SAMPLES, root_facts

LINE = "ERROR [rank 2] currency table mismatch"


def test_the_level_first_record_names_the_rank_and_its_message():
    # behind accelerate's `[default2]:` prefix (the --tee form), and bare (the config-file form, rank 1)
    assert root_facts("invx_exit2_np5_r2_tee")[:4] == ("python.logged_error", "python_exception", 2, 45)
    assert root_facts("invx_exit2_np3_r1_accconfig")[:3] == ("python.logged_error", "python_exception", 1)


def test_an_info_record_of_the_same_shape_is_no_error(tmp_path):
    text = (SAMPLES / "invx_exit2_np5_r2_tee.log").read_text()
    assert LINE in text
    log = tmp_path / "edited.log"
    log.write_text(text.replace(LINE, LINE.replace("ERROR", "INFO")))
    rc = triage([str(log)]).to_dict()["root_cause"]
    # without the record nothing says why rank 2 left: its exit code 2 is all that is left
    assert (rc["rule_id"], rc["rank"]) == ("signal.exit_nonzero", 2)
