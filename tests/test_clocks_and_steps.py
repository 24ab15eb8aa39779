"""Which rank failed first, read from the times its lines carry (a logger's record before an unstamped
traceback, epoch seconds, a bare time of day, a rank field after the time), the optimizer step and
autograd, on real CPU runs of torch 2.13 (sample_logs/cpu_adhoc, the 60th-62nd batches, each labelled
before triage ran; the test names the run)."""

from __future__ import annotations

import pytest

from logtriage.analysis.timestamps import clearly_before, parse_stamp
from logtriage.demux.line_marks import find_rank_marker

from sample_roots import root_cause as _root


@pytest.mark.parametrize("text, rank", [
    ("2026-12-03T11:19:07.145+00:00 rank2 INFO started: world_size=4 node=0 tz=UTC", 2),
    ("1796297283.230 r0 INFO step 1 loss 0.6539", 0),
    ("11:18:28.879 rank3: step 1", 3),
    ("2026-12-03 11:19:07 running r1 INFO", None),    # a word between the time and `r1`
    ("1796297283.230 r0 started", None),               # `rN` only before a level word
    # a script's own `ERROR rank N: ` before a count per rank in its message (cpu_adhoc 165th batch)
    ("ERROR rank 2: too few identities per rank: 1 < P=4 (ids.txt has 48 identities for world size 3)", 2),
    ("too few identities per rank: 1", None),
])
def test_a_rank_field_right_after_the_lines_time(text, rank):
    assert find_rank_marker(text) == rank


def test_epoch_seconds_and_a_bare_time_of_day_are_compared_only_with_their_own_kind():
    epoch, later_epoch = parse_stamp("1796296782.695 r2 ERROR x"), parse_stamp("1796296783.691 r5 ERROR y")
    clock, iso = parse_stamp("11:18:28.879 rank=3 INFO"), parse_stamp("2026-12-03 11:18:29,100 [INFO] rank1: x")
    assert (epoch.family, clock.family, iso.family) == ("epoch", "clock", "iso")
    assert clearly_before(epoch, later_epoch) is True
    assert clearly_before(clock, iso) is None and clearly_before(epoch, iso) is None


@pytest.mark.parametrize("slug, rank, line", [
    # the culprit's KeyError, logged with logger.exception into a block-buffered stream, reaches the
    # console after the launcher's SIGTERMs; its record line's time is a second before the other
    # rank's ValueError (ISO with a zone, epoch seconds under --tee, str(datetime.now()) under srun)
    ("clk_two_np4_r1_plain", 1, 62),
    ("clk_two_np6_r2_tee3", 2, 95),
    ("clk_two_np4_r3_srun2", 3, 123),
])
def test_an_unstamped_traceback_takes_its_error_records_time(slug, rank, line):
    rc = _root(slug)
    assert (rc["rule_id"], rc["rank"], rc["line"], rc["exception_type"]) == ("python.exception", rank, line, "KeyError")


def test_a_timed_out_rank_that_never_printed_a_step_is_behind_the_others():
    # rank 2 alone wraps its optimizer in ZeroRedundancyOptimizer; its step broadcasts shards the others
    # never join: ranks 2 and 3 time out, ranks 0 and 1 see the peer close, only rank 2 has no step line
    rc = _root("optim_zeroone_np4_r2_plain")
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("gloo.timeout", "collective_timeout", 2, 63)
    assert "never printed a step line" in rc["reasons"][0]


def test_a_comm_hook_that_returns_a_tensor_is_ddp_usage():
    rc = _root("bw_commwrong_np4_r2_plain")
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("ddp.reducer_usage", "ddp_usage", 2, 23)


def test_a_node_in_another_time_zone_is_read_on_the_other_nodes_clock():
    # node 1 (ranks 3-5) logs in TZ=Asia/Shanghai, node 0 in UTC: the same step eight hours apart;
    # rank 4's KeyError (node 1, 19:30:37.659) came a second before rank 1's ValueError (node 0, 11:30:38.661)
    rc = _root("clk_twotz_np6_r4_pdsh2")
    assert (rc["rule_id"], rc["rank"], rc["exception_type"]) == ("python.exception", 4, "KeyError")


def test_a_rank_that_fell_silent_while_the_others_heartbeats_repeated_is_the_one_they_waited_for():
    # `timeout 28 torchrun ...`: rank 2's regex holds the GIL (its heartbeat thread stops too) after
    # `step 3: fetching batch`; ranks 0, 1, 3 log `heartbeat step=3` until torchrun gets SIGTERM
    rc = _root("clk_regexhung_np4_r2_plain")
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("hang.stopped_while_waiting", "hang", 2)
    assert "before the others began repeating" in rc["reasons"][-1]
