"""Two readings of stop 57.

A transformers.Trainer run under `accelerate launch` whose script prints no step lines of its own: the Trainer's log
records (`{'loss': ..., 'epoch': ...}`, then `{'train_runtime': ...}` when train() returns) are its progress, and
rank 0's `rank 0 saved export` after them is the run's end (cpu_adhoc 518th batch's control run, once read as hung).

`accelerate launch --num_machines 2` without `--main_process_ip`/`--main_process_port` hands torchrun the rendezvous
endpoint 'None:None' (accelerate/utils/launch.py), which torchrun's parser refuses: accelerate's usage, not
torchrun's own command line (public round 139: huggingface/accelerate#2240)."""

from __future__ import annotations

from pathlib import Path

from sample_roots import edited_report, sample_report, text_root

PUBLIC = Path(__file__).resolve().parent.parent / "sample_logs" / "public139"
CONTROL = "dialect_none_np4_rnone_hfacc"


def test_a_trainer_run_that_saved_its_export_after_train_runtime_is_ok():
    report = sample_report(CONTROL)
    assert report["verdict"] == "ok"
    assert report["root_cause"] is None


def test_without_the_trainer_records_the_same_end_is_still_output_that_stopped(tmp_path):
    # the same log with the Trainer's records renamed: nothing before the save says the run made progress
    report = edited_report(CONTROL, "{'", "{'x_", tmp_path)
    rc = report["root_cause"]
    assert (report["verdict"], rc["rule_id"], rc["category"]) == ("hung", "hang.output_stopped", "hang")


def _root(text: str, tmp_path: Path) -> tuple:
    rc = text_root(text, tmp_path)
    return rc["rule_id"], rc["category"], rc["line"]


def test_a_none_port_in_the_rendezvous_endpoint_is_accelerates_usage(tmp_path):
    text = (PUBLIC / "accelerate2240_multinode_launch_same_network_value_rdzv_endpoint_none.log").read_text()
    assert _root(text, tmp_path) == ("launcher.accelerate_usage", "launch_usage", 1)


def test_a_malformed_port_of_torchruns_own_endpoint_stays_torchruns_usage(tmp_path):
    line = ("ValueError: The port number of the rendezvous endpoint 'node01:29x00' must be an integer "
            "between 0 and 65536.\n")
    assert _root(line, tmp_path) == ("launcher.torchrun_usage", "launch_usage", 1)
