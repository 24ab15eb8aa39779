"""Readings the 644th-647th batches of real CPU runs (torch 2.13, sample_logs/cpu_adhoc, labelled before triage ran)
asked for, of the collectives beyond all_reduce and barrier: the checks c10d and gloo make of a call's own arguments
before sending anything (a reduce_scatter_tensor input that is not world size times the output, all_to_all_single
split sizes that do not add up, a root rank outside the group, MAX over complex tensors, a dtype gloo has no case
for) name the rank that made the call; and of ranks that all timed out in the same collective, the one whose call
came from another function of the program skipped or added a call of the others' block."""

from __future__ import annotations

import pytest
from sample_roots import edited_report, facts_of, sample_report

SKIPPED = "bandicoot_skip_one_np8_r3_bashloop"


@pytest.mark.parametrize("slug, expected", [
    # torchrun --tee 3, 5 ranks: rank 2's reduce_scatter_tensor input two elements longer ("Check failed:
    # outputShape[0] * worldSize == inputShape[0] (15 vs. 17)", ProcessGroupGloo.cpp)
    ("markhor_reducescatter_np5_r2_tee", ("gloo.invalid_tensor_size", "collective_mismatch", 2, 17, "RuntimeError")),
    # accelerate under torchrun --tee 3, 5 ranks: rank 2's all_to_all_single split sizes summing past its tensor
    ("tamandua_a2a_splits_np5_r2_tee", ("gloo.alltoallv_lengths", "collective_mismatch", 2, 27, "RuntimeError")),
    # a job script around torchrun, 8 ranks: rank 7 reduced to dst=8 ("ProcessGroupGloo::reduce: invalid root rank: 8")
    ("markhor_reduce_dst_np8_r7_wrapper", ("dist.invalid_collective_argument", "collective_error", 7, 34,
                                           "RuntimeError")),
    # two torchrun agents as pdsh nodes, 4 ranks: rank 2 all_reduced a complex tensor with MAX
    ("markhor_complex_max_np4_r2_pdsh2", ("dist.invalid_collective_argument", "collective_error", 2, 18,
                                          "ValueError")),
    # accelerate's script under torchrun, 3 ranks: rank 1 all_reduced a uint16 tensor ("Invalid scalar type")
    ("tamandua_bad_dtype_np3_r1_torchrun", ("ddp.unsupported_dtype", "ddp_usage", 1, 28, "RuntimeError")),
])
def test_a_collective_call_refused_for_its_own_arguments_names_the_caller(slug, expected):
    assert facts_of(sample_report(slug)) == expected


def test_a_rank_whose_waiting_call_came_from_another_function_skipped_one():
    # a bash loop, 8 ranks: rank 3 skipped the second of three all_reduces in `plant`; every rank timed out, the
    # others in `plant` (lines 139 and 140), rank 3 in its gradient all_reduce in `main`
    assert facts_of(sample_report(SKIPPED)) == ("gloo.timeout", "collective_timeout", 3, 74, "RuntimeError")


def test_with_every_call_from_one_function_no_rank_is_named(tmp_path):
    report = edited_report(SKIPPED, 'fault645.py", line 195, in main\n[rank3]:     dist.all_reduce(p.grad)',
                           'fault645.py", line 140, in plant\n[rank3]:     dist.all_reduce(torch.ones(4))', tmp_path)
    assert facts_of(report)[:3] == ("gloo.timeout", "collective_timeout", None)
