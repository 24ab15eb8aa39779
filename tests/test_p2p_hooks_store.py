"""Point-to-point pipelines, DDP communication hooks and hand-made store coordination, on real CPU
runs of torch 2.13 (sample_logs/cpu_adhoc, the 87th to 89th batches, each labelled before triage
ran; the test names the run)."""

from __future__ import annotations


import pytest

from logtriage.analysis.loss_outlier import _left_the_others
from logtriage.analysis.odd_start import _own_index, _own_lines
from logtriage.api import triage

from sample_roots import SAMPLES
from sample_roots import verdict_and_root as _root


@pytest.mark.parametrize("slug, rank", [
    # the leader (rank 2) never sets `job/ready`: ranks 0, 1, 3 raise `DistStoreError: wait timeout ...
    # keys: /default_pg/0//job/ready` in the program's own publish_config, before any step; rank 2 is in
    # broadcast_object_list and loses its peers
    ("kvst_neverset_np4_r2_plain", 2),
    ("kvst_neverset_np6_r3_tee3role", 3),
    # a barrier made of store.add and store.wait that rank 4 skips: the others wait on `barrier/.../done`
    ("kvst_addskip_np6_r4_wrapper", 4),
    # stage 3 sends to rank 5 of a 5-rank job: gloo connects lazily and waits in the store for the
    # address of a rank outside the world (`/default_pg/0//cpu//0/5`), inside isend
    ("p2p_beyond_np5_r3_tee3", 3),
])
def test_a_store_wait_only_a_formed_group_makes_is_a_wait_for_the_rank_missing_from_it(slug, rank):
    assert _root(slug) == ("failed", "dist.store_wait_in_collective", "collective_timeout", rank)


def test_a_store_wait_while_the_default_group_forms_stays_a_rendezvous_failure():
    # every rank waits for `/default_pg/0//cpu//0/2` inside init_process_group: the group never formed
    assert _root("dup_rank_np4_r2_plain")[1:3] == ("dist.store_wait_timeout", "rendezvous")


def test_a_port_clash_in_the_programs_own_server_after_the_group_formed_is_the_hosts():
    # rank 2's metrics TCPStore(is_master=True) meets EADDRINUSE in main() while the others wait in a barrier
    assert _root("kvst_storeport_np6_r2_loginfo") == ("failed", "host.port_taken", "environment", 2)


def test_the_launchers_master_port_clash_stays_a_rendezvous_failure():
    assert _root("port_busy_np4_rall_tee")[1:3] == ("dist.port_in_use", "rendezvous")


@pytest.mark.parametrize("slug, sender", [
    # stage 3 sends a (4, 12) activation where stage 4 posted (4, 8): stage 4 aborts (`op.preamble.length <=
    # op.nbytes. 192 vs 128`, -6); stage 3's dist.send breaks on the reset connection
    ("p2p_shape_np6_r3_detail", 3),
    # stage 0 sends float64 through its own `send` helper around isend(...).wait()
    ("p2p_dtype_np4_r0_loginfo", 0),
    ("p2p_dtype_np5_r2_tee3", 2),
])
def test_a_size_abort_in_a_point_to_point_exchange_goes_to_the_rank_whose_send_broke(slug, sender):
    assert _root(slug) == ("failed", "gloo.size_mismatch", "collective_mismatch", sender)


def test_a_rank_whose_start_line_names_another_count_is_the_odd_one_even_when_no_prefix_names_it():
    # `rank 1 stage 1/4 ... micro-batches 5` where the others say 4; the lines carry no prefix, and every rank
    # times out in send or recv
    assert _root("p2p_mbcount_np4_r1_plain") == ("failed", "gloo.timeout", "collective_timeout", 1)
    assert _own_lines(None, "rank 3 stage 3/4 world 4") == [(3, "rank 3 stage 3/4 world 4")]
    assert _own_index(3).sub("#/", "stage 3/4 world 4 lr 3/10") == "stage #/4 world 4 lr #/10"
    assert _own_index(0).sub("#/", "lr 0.05 stage 0/4") == "lr 0.05 stage #/4"


def test_a_stop_after_a_silent_start_is_a_hang_even_when_no_line_names_a_rank():
    # nothing after the four start lines for 35 s, then `timeout` SIGTERMs torchrun; the agent stops four
    # workers by pid, and no line carries a rank prefix
    assert _root("p2p_tag_np4_r1_hang")[:3] == ("hung", "hang.stopped_while_waiting", "hang")


def test_a_stop_when_only_one_rank_had_printed_a_step_is_a_hang_at_that_rank():
    # rank 1's hook does not communicate: it alone prints `step 1`, the others wait in step 1's all-reduce
    assert _root("chook_onerankhang_np4_r1_hang") == ("hung", "hang.stopped_while_waiting", "hang", 1)


@pytest.mark.parametrize("slug, rank", [
    # every rank raises `EMA model loss is nan` at step 4; at step 3 rank 2 printed loss 1848.8 where the
    # others printed about 1.4 (its unscaled feature), and fp16_compress_hook spread it
    ("chook_fp16inf_np4_r2_plain", 2),
    ("chook_fp16inf_np6_r5_wrapper", 5),
])
def test_a_nan_on_every_rank_starts_at_the_rank_whose_loss_left_the_others_first(slug, rank):
    assert _root(slug) == ("failed", "numerical.checked_nonfinite", "numerical", rank)


def test_a_loss_leaves_the_others_only_when_they_agree_and_it_alone_is_far_off():
    assert _left_the_others({0: 1.4, 1: 1.3, 2: 1848.8, 3: 1.5}) == 2
    assert _left_the_others({0: 1.4, 1: float("nan"), 2: 1.5}) == 1
    assert _left_the_others({0: 1.4, 1: 1.3, 2: 1.5}) is None            # nobody apart
    assert _left_the_others({0: 1.4, 1: 900.0, 2: 1848.8}) is None       # the others do not agree
    assert _left_the_others({0: 1.4, 1: 1848.8}) is None                 # two ranks: no majority


# The 90th to 92nd batches: several models in one job, subgroups, asynchronous collectives.

@pytest.mark.parametrize("slug", [
    # every rank's last line is `rank N final 11.1705 done`, and torchrun at its default level prints nothing
    # on success; in the pdsh form the lines carry `worker-K: ` before them
    "aop_none_np4_rnone_plain",
    "aop_none_np4_rnone_pdsh2",
])
def test_a_log_whose_every_rank_last_says_done_is_a_finished_run(slug):
    report = triage([str(SAMPLES / f"{slug}.log")]).to_dict()
    assert (report["verdict"], report["root_cause"]) == ("ok", None)


@pytest.mark.parametrize("slug, rank", [
    # rank 2 creates its pair groups in another order: ranks wait in new_group for a subgroup's key
    # (`/default_pg/0//4//cpu//0/0`) of the default group's store, which only a formed default group has
    ("subg_order_np4_r2_plain", 2),
    ("subg_skipcreate_np6_r3_loginfo", 3),
])
def test_a_store_wait_for_a_subgroups_key_is_a_collective_timeout_not_a_rendezvous(slug, rank):
    assert _root(slug) == ("failed", "dist.store_wait_in_collective", "collective_timeout", rank)


@pytest.mark.parametrize("slug, rank", [
    # rank 3 alone prints `'freeze_d': True` in its settings line; gloo aborts rank 2, the receiver of the
    # all-reduce whose size differs
    ("amod_reqgrad_np4_r3_plain", 3),
    ("amod_reqgrad_np6_r4_wrapper", 4),
])
def test_a_size_abort_goes_to_the_one_rank_whose_start_line_differs(slug, rank):
    assert _root(slug) == ("failed", "gloo.size_mismatch", "collective_mismatch", rank)
