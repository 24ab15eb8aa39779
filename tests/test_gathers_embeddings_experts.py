"""Contrastive losses over gathered tensors, sparse embeddings, mixture-of-experts all-to-all, process
groups re-made in one job, randomness that makes ranks diverge and variable-size inputs, on real CPU
runs of torch 2.13 (sample_logs/cpu_adhoc, the 93rd to 98th batches, each labelled before triage ran;
the test names the run)."""

from __future__ import annotations


import pytest

from logtriage.api import triage
from logtriage.demux.line_marks import find_rank_marker
from logtriage.demux.prefixes import Dialect, strip_prefixes
from logtriage.scan_result import step_number

from sample_roots import SAMPLES
from sample_roots import verdict_and_root as _root


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
    assert _root("cgat_tau0_np4_r2_tee3") == ("failed", "numerical.checked_nonfinite", "numerical", 2)


def test_a_key_value_it_counter_is_a_step_and_a_longer_word_ending_in_it_is_not():
    from logtriage.tui.model.align import _steps
    assert step_number("rank4/6 it=7 loss=0.8586") == 7
    assert step_number("split=3 limit=12 exit=1") is None
    # the viewer's byte reading of the same counters (its pattern is the scan's, encoded)
    assert _steps([b"rank0/6 it=3 loss=0.5", b"split=9 limit=12", b"[0] it 4/7 | loss 0.4", b"step 5 loss 0.3"]) == [3, 3, 4, 5]
    # stall_fh_np6_r4_tee: faulthandler fires on all six ranks; rank 4, the only one that printed
    # `it=4` (the others `it=3`), stalled there
    assert _root("stall_fh_np6_r4_tee")[3] == 4


@pytest.mark.parametrize("slug", ["rng_none_np4_rnone_plain", "rng_droppathfu_np4_rnone_tee3role",
                                  "rng_evalrandshared_np5_rnone_plain"])
def test_every_rank_summing_up_after_done_is_a_finished_run(slug):
    # each rank's last line is `rank 3 done: 20 steps, mean loss 1.4187`, and torchrun prints nothing on success
    report = triage([str(SAMPLES / f"{slug}.log")]).to_dict()
    assert report["verdict"] == "ok"


def test_a_rank_prefix_repeated_once_per_init_is_stripped_to_the_message():
    # a sweep that called init_process_group three times: torch's excepthook prefix three times over
    line = "[rank2]: [rank2]: [rank2]: ValueError: Default process group has not been initialized"
    got = strip_prefixes(line, Dialect())
    assert (got.rank, got.text) == (2, "ValueError: Default process group has not been initialized")
    # the destroyed group's error (life_afterdestroy_np4_r2_plain) then keeps its exception type
    report = triage([str(SAMPLES / "life_afterdestroy_np4_r2_plain.log")]).to_dict()
    assert (report["root_cause"]["rank"], report["root_cause"]["exception_type"]) == (2, "ValueError")


def test_a_scripts_rank_led_lines_name_their_rank_after_more_words():
    assert find_rank_marker("rank 2 trial 1 lr 0.1 step 1 loss 1.3803") == 2
    assert find_rank_marker("rank 3 stage 1 sent activations") == 3
    assert find_rank_marker("rank 1 resuming from ckpt/step_40.pt") == 1
    assert find_rank_marker("rank 5 failed to pass the barrier") is None   # a word about another rank, maybe


def test_terminate_yields_to_its_what_line_below_the_ranks_buffered_stdout():
    # `[default1]:terminate called ...`, then rank 1's own stdout lines, then `[default1]:  what(): ... 608 vs 352`
    assert _root("vlen_localmax_np5_r1_tee3") == ("failed", "gloo.size_mismatch", "collective_mismatch", 1)


@pytest.mark.parametrize("slug, rank", [
    # rank 0's start line says `shard 52 samples` where the others say 51 (256 samples over 5 ranks): the
    # remainder's share, not a rank set up its own way; gloo aborted the rank that broke out of the loop
    ("rng_randbreak_np5_r4_tee3role", 4),
    ("rng_evalrand_np3_r1_wrapper", 1),
])
def test_rank_0s_remainder_share_is_no_odd_start(slug, rank):
    assert _root(slug)[3] == rank
