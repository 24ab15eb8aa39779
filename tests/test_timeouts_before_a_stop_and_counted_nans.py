"""Two readings of real CPU runs (torch 2.13, gloo; sample_logs/cpu_adhoc, labelled by hand before triage ran):

- ranks that gave up waiting for a slow rank (gloo's `Timed out waiting 12000ms`), and then, 90 s later, the
  job stopped from outside (`timeout` SIGTERMs a hand-made loop; Lightning's handler on the slow rank says
  `[rank: 1] Received SIGTERM: 15`): the timeouts came first and point at the rank missing from them, as
  without the stop (batch 461);
- the same FloatingPointError on every rank after the all-reduce spread one rank's NaN inputs, where each
  rank counted the non-finite values it read and only one counted any (`rank 1: ...; 384 non-finite input
  values`, the others `0 non-finite input values`): that rank started it (batch 465)."""

from __future__ import annotations

from sample_roots import edited_report, root_facts, verdict_and_root


def test_collective_timeouts_before_a_stop_point_at_the_missing_rank():
    assert verdict_and_root("wing_slowpeak_np3_r1_plbashloop") == (
        "failed", "gloo.timeout", "collective_timeout", 1)
    # rank 0's timeout (line 141) is the first; the stop is line 265
    assert root_facts("wing_slowpeak_np3_r1_plbashloop")[3] == 141


def test_a_stop_with_no_timeout_before_it_stays_the_hang_it_ended():
    # the same kind of run stopped while every rank still waited (no gloo timeout under a 300 s limit)
    assert verdict_and_root("wing_slowpeak_np4_r2_plloglevel")[:3] == ("hung", "hang.stopped_while_waiting", "hang")


def test_the_one_rank_that_counted_nonfinite_inputs_started_a_shared_nan():
    assert root_facts("swell_spike_np3_r1_detail")[:3] == ("numerical.checked_nonfinite", "numerical", 1)


def test_no_rank_is_named_when_none_counted_any(tmp_path):
    report = edited_report("swell_spike_np3_r1_detail", "384 non-finite input values", "0 non-finite input values",
                           tmp_path)
    assert report["root_cause"]["rank"] != 1
    assert report["root_cause"]["category"] == "numerical"
