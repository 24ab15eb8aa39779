"""Contrastive losses over gathered tensors, sparse embeddings and mixture-of-experts all-to-all, on
real CPU runs of torch 2.13 (sample_logs/cpu_adhoc, the 93rd to 95th batches, each labelled before
triage ran; the test names the run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from logtriage.api import triage
from logtriage.scan_result import step_number

SAMPLES = Path(__file__).resolve().parent.parent / "sample_logs" / "cpu_adhoc"


def _root(slug: str) -> tuple:
    report = triage([str(SAMPLES / f"{slug}.log")]).to_dict()
    rc = report["root_cause"]
    return report["verdict"], rc["rule_id"], rc["category"], rc["rank"]


@pytest.mark.parametrize("slug, rank", [
    # the rank that cached its receive counts and skipped the count exchange: its next all_to_all_single
    # pairs with the peers' count exchange and gloo's own length check refuses its split sizes
    ("moe_skipcount_np4_r1_plain", 1),
    ("moe_skipcount_np5_r3_detail", 3),
    ("moe_skipcount_np6_r5_pdsh2", 5),
])
def test_an_all_to_all_whose_split_sizes_disagree_with_themselves_is_a_collective_mismatch(slug, rank):
    assert _root(slug) == ("failed", "gloo.alltoallv_lengths", "collective_mismatch", rank)


@pytest.mark.parametrize("slug, rank", [
    # rank 4 sends its split counts as int32: gloo's size check aborts it (`8 vs 4`), and ranks 1 and 5,
    # which read its 4-byte counts into int64 slots, ask the host for 1,020 TiB and 1.7 million TiB
    ("moe_cntdtype_np6_r4_detail", 4),
    ("moe_cntdtype_np4_r2_plain", 2),
])
def test_an_allocation_sized_by_a_mismatched_message_yields_to_the_size_check(slug, rank):
    assert _root(slug) == ("failed", "gloo.size_mismatch", "collective_mismatch", rank)


def test_ddp_shapes_that_every_rank_but_rank_0_finds_differ_from_rank_0s_blame_rank_0():
    # rank 0's node holds a stale vocabulary file: ranks 1-5 raise `params[0] in this process with sizes
    # [1000, 16] appears not to match sizes of the same param in process 0`; rank 0 only loses its peers
    assert _root("spemb_vocab_np6_r0_tee3") == ("failed", "ddp.param_shape_mismatch", "ddp_usage", 0)
    # one rank's vocabulary differs: only it raises, and it stays the culprit
    assert _root("spemb_vocab_np4_r2_plain") == ("failed", "ddp.param_shape_mismatch", "ddp_usage", 2)


@pytest.mark.parametrize("slug, rank", [
    # `FloatingPointError: rank 2: aux is nan at step 3, stopping`: the script's own check of its
    # load-balancing loss (a softmax of logits divided by a temperature of 0; an expert with no tokens)
    ("moe_gatetemp_np4_r2_tee3", 2),
    ("moe_empty_np4_r3_plain", 3),
    ("moe_empty_np6_r0_loginfo", 0),
])
def test_a_floating_point_error_from_a_scripts_own_check_is_numerical(slug, rank):
    assert _root(slug) == ("failed", "numerical.checked_nonfinite", "numerical", rank)


def test_a_floating_point_error_about_the_loss_stays_the_loss_rule():
    # `FloatingPointError: rank 2: non-finite loss nan at step 1 (tau=0.0)`
    assert _root("cgat_tau0_np4_r2_tee3") == ("failed", "numerical.loss_nan", "numerical", 2)


def test_a_key_value_it_counter_is_a_step_and_a_longer_word_ending_in_it_is_not():
    assert step_number("rank4/6 it=7 loss=0.8586") == 7
    assert step_number("split=3 limit=12 exit=1") is None
    # stall_fh_np6_r4_tee: faulthandler fires on all six ranks; rank 4, the only one that printed
    # `it=4` (the others `it=3`), stalled there
    assert _root("stall_fh_np6_r4_tee")[3] == 4
