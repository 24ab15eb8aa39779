"""The C++ runtime's `terminate called after throwing an instance of 'std::out_of_range'` names the exception
that nothing caught: the report gives that type for the root line itself, as it does for the `what():` line under
it (TensorPipe's listener in pytorch/pytorch#39504 and #39464, public round 138)."""

from __future__ import annotations

from pathlib import Path

import pytest

from logtriage.api import triage

PUBLIC138 = Path(__file__).resolve().parent.parent / "sample_logs" / "public138"


@pytest.mark.parametrize("name", ["pytorch39504_tensorpipe_rpc_test_worker_terminate_out_of_range",
                                  "pytorch39464_tensorpipe_dist_autograd_test_terminate_out_of_range"])
def test_the_thrown_type_is_the_roots_exception(name):
    [log] = PUBLIC138.glob(name + "*.log")
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["exception_type"]) == ("signal.native_terminate", "crash_signal",
                                                                     "std::out_of_range")
    assert rc["text"].startswith("terminate called after throwing")


def test_a_terminate_without_an_exception_names_no_type(tmp_path):
    [log] = PUBLIC138.glob("pytorch39504*.log")
    text = log.read_text()
    assert "terminate called after throwing an instance of 'std::out_of_range'\n" in text
    assert "  what():  _Map_base::at\n" in text
    edited = tmp_path / "edited.log"
    edited.write_text(text.replace("terminate called after throwing an instance of 'std::out_of_range'\n",
                                              "terminate called without an active exception\n")
                      .replace("  what():  _Map_base::at\n", ""))
    rc = triage([str(edited)]).to_dict()["root_cause"]
    assert rc["exception_type"] is None
