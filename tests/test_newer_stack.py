"""Readings the 624th-627th batches of real CPU runs (torch 2.13, sample_logs/cpu_adhoc, labelled before triage ran)
asked for, of the newer distributed stack: gloo's all_to_all_single refusing a tensor of another size
(`alltoall.cc ... in->size == out->size`, `in->size % context->size == 0`) is a shape the ranks disagree on; a NaN
loss every other rank printed at the same step and went on from (a Trainer callback's placeholder) is no failure of
the rank killed before its next line; and a C++ exception's namespace (`gloo::EnforceNotMet`) is no part of the
type a label names."""

from __future__ import annotations

from logtriage.api import triage
from logtriage.regress.cases import short_name
from sample_roots import SAMPLES, edited_report, facts_of, sample_report


def test_an_all_to_all_input_not_divisible_by_the_world_is_a_size_the_ranks_disagree_on():
    # torchrun --tee 3 + Lightning, 8 ranks: rank 7's all_to_all_single input does not divide by 8
    assert facts_of(sample_report("wallaby_a2a_size_np8_r7_pltee")) == (
        "gloo.invalid_tensor_size", "collective_mismatch", 7, 170, "RuntimeError")


def test_an_all_to_all_output_of_another_size_in_a_folder_of_rank_files():
    # a bash loop writing rank<r>.log files, 4 ranks: rank 1's output is not its input's size
    rc = triage([str(SAMPLES / "kudu_alltoall_size_np4_r1_files")]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("gloo.invalid_tensor_size", "collective_mismatch", 1)
    assert "alltoall.cc:30] in->size == out->size" in rc["text"]


def test_an_output_list_of_another_length_stays_the_ranks_own_misuse():
    # all_gather into a list of 2 on a world of 3: the rank's own call, not a shape its peers disagree on
    assert facts_of(sample_report("gather_len_np3_r2_loglevel"))[:3] == ("python.exception", "python_exception", 2)


SIGKILL = "epiphyte_sigkill_np4_r0_hf"
FINITE = "loss 0.9046653509140015"


def test_a_placeholder_nan_every_rank_printed_is_no_failure_of_the_rank_killed_after_it():
    # torchrun + transformers.Trainer, 4 ranks: every rank's callback printed `step 1 loss nan` (no loss logged yet),
    # ranks 1-3 printed finite step-2 losses, and rank 0 was SIGKILLed before its own step-2 line
    assert facts_of(sample_report(SIGKILL))[:3] == ("signal.sigkill", "crash_signal", 0)


def test_a_nan_the_other_ranks_kept_is_the_failure(tmp_path):
    report = edited_report(SIGKILL, FINITE, "loss nan", tmp_path)
    assert report["root_cause"]["rule_id"] == "numerical.loss_nan"


def test_a_cpp_exceptions_namespace_is_not_part_of_its_name():
    assert short_name("gloo::EnforceNotMet") == "EnforceNotMet"
    assert short_name("torch.distributed.checkpoint.api.CheckpointException") == "CheckpointException"
    assert sample_report("lapwing_fsdp_shape_np4_r0_wrapper")["root_cause"]["exception_type"] == "gloo::EnforceNotMet"
