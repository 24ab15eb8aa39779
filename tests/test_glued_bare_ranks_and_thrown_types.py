"""Two readings of real CPU runs (torch 2.13, gloo; sample_logs/cpu_adhoc, labelled by hand before triage ran):

- unbuffered ranks write a print and its newline separately, so a script's bare `rank 2: ERROR ...` can land
  right after another rank's print, before its newline (`rank 1 step 0 loss 1.1142 p_acc 0.125rank 2: ERROR
  station HRV clock drift ...`, batch 459): the demuxer cuts the line there, and rank 2's error is its own;
- an exception nothing caught in C++ (`terminate called after throwing an instance of 'gloo::EnforceNotMet'`,
  then `  what():  [enforce fail at ...]`) has its type on the line above its message: the report names it."""

from __future__ import annotations

import pytest

from logtriage.api import triage
from logtriage.demux.split import split_glued
from sample_roots import root_facts


def test_a_bare_rank_error_glued_onto_another_ranks_print_is_its_own_rank():
    assert root_facts("phase_exit2_np3_r2_wrapper")[:4] == ("python.logged_error", "python_exception", 2, 14)


@pytest.mark.parametrize("line, parts", [
    ("rank 1 step 0 loss 1.1142 p_acc 0.125rank 2: ERROR station HRV clock drift",
     ["rank 1 step 0 loss 1.1142 p_acc 0.125", "rank 2: ERROR station HRV clock drift"]),
    ("rank 0 step 1 loss 1.9445 lesion 0.000rank 3 step 1 loss 1.9445",
     ["rank 0 step 1 loss 1.9445 lesion 0.000", "rank 3 step 1 loss 1.9445"]),
    # words, not a glued print: `rank 2` after a space or a letter stays in the line
    ("rank 1 waits for rank 2 to send its shard", ["rank 1 waits for rank 2 to send its shard"]),
    ("rank 1 local_rank 0 device cpu", ["rank 1 local_rank 0 device cpu"]),
    ("step 3 done (rank 2: ok)", ["step 3 done (rank 2: ok)"]),
])
def test_only_a_bare_marker_glued_onto_a_print_is_cut(line, parts):
    assert split_glued(line) == parts
    assert "".join(split_glued(line)) == line


def test_a_cpp_exception_names_its_type_from_the_terminate_line_above_its_message():
    # `terminate called after throwing an instance of 'gloo::EnforceNotMet'` at line 15, its `what():` at 16
    assert root_facts("recipe_gathershape_np3_r2_acc") == (
        "gloo.size_mismatch", "collective_mismatch", 2, 16, "gloo::EnforceNotMet")


def test_the_thrown_type_is_read_behind_torchs_rank_prefix_too(tmp_path):
    log = tmp_path / "what.log"
    log.write_text("[rank0]: step 1\n"
                   "[rank2]:terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
                   "[rank2]:  what():  [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                   "pair.cc:456] op.preamble.length <= op.nbytes. 20 vs 18. Received data size doesn't match expected "
                   "size. Is there a distributed collective mismatch in your code?\n")
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["line"], rc["exception_type"]) == ("gloo.size_mismatch", 2, 3,
                                                                            "gloo::EnforceNotMet")


def test_a_what_line_with_no_terminate_line_above_names_no_cpp_type(tmp_path):
    log = tmp_path / "what.log"
    log.write_text("[rank0]: step 1\n"
                   "[rank2]:  what():  [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                   "pair.cc:456] op.preamble.length <= op.nbytes. 20 vs 18. Received data size doesn't match expected "
                   "size. Is there a distributed collective mismatch in your code?\n")
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert rc["rule_id"] == "gloo.size_mismatch" and rc["exception_type"] is None
