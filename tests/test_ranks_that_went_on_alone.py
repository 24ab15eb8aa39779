"""A hang stopped from outside where every rank's last line is one same message (numbers aside) but one
rank's, which printed that message too and then went on alone: the others waited for it at the next
collective; and a rank that printed its own work after the others' collective timeouts and only then lost its
peers: it came to the collective late. Real CPU runs of torch 2.13 (sample_logs/cpu_adhoc, the 210th-214th and
300th-301st batches, each labelled before triage ran; the test names the run)."""

from __future__ import annotations

from sample_roots import edited_report, verdict_and_root


def test_the_rank_that_went_on_past_the_line_all_ended_on_is_the_one_they_waited_for():
    # ranks 0 and 1 end on `rank N: eval PSNR in ... dB -> out ... dB`; rank 2 printed that too, then `rank 2:
    # writing reconstruction grid (32, 64) to .../recon_grid_rank2.pt`; `timeout` stops the job (213th batch)
    assert verdict_and_root("dae_slowgrid_np3_r2_plain") == ("hung", "hang.stopped_while_waiting", "hang", 2)


def test_a_rank_that_ended_on_the_shared_line_went_nowhere(tmp_path):
    # the same run without rank 2's extra line: every rank ended on the same message, nothing names a rank
    report = edited_report("dae_slowgrid_np3_r2_plain",
                           "rank 2: writing reconstruction grid (32, 64) to /tmp/job_work/recon_grid_rank2.pt",
                           "rank 2: eval PSNR in 12.72 dB -> out 9.28 dB", tmp_path)
    assert report["verdict"] == "hung" and report["root_cause"]["rank"] is None


def test_two_ranks_progress_glued_on_one_line_is_no_going_on():
    # `rank 1 step 2 ... ntok 80rank 2 step 2 ... ntok 140` reads as rank 1's line, unlike the others'; but it
    # is progress, not work of its own: every rank waits (a --rank -1 fault), no rank is named
    assert verdict_and_root("vlen_bucketwait_np3_rall_hang") == ("hung", "hang.stopped_while_waiting", "hang", None)


def test_the_rank_that_reached_the_others_step_and_then_said_what_none_said_is_the_one_they_waited_for():
    # every rank at step 5; ranks 0 and 1 then `rank N preview next event: note_on 48`, rank 2 `preview next event:
    # time_shift 16` and then `rank 2: rendering preview sample (4096 events) to ...`; `timeout` stops it (210th)
    assert verdict_and_root("midi_render_np3_r2_plain") == ("hung", "hang.stopped_while_waiting", "hang", 2)


def test_under_a_hand_made_loop_a_line_led_by_its_rank_and_any_word_is_that_ranks():
    # bare `python` per rank, no prefixes: `rank 2 task 0 step 3 ...`, then `rank 2 re-evaluating all earlier tasks
    # before reducing task 0 loss` while ranks 0 and 1 end on their step 3; the output stops (218th batch)
    assert verdict_and_root("hnet_slowreg_np3_r2_bashloop") == ("hung", "hang.output_stopped", "hang", 2)


def test_late_start_up_lines_every_rank_printed_are_no_work_of_the_late_rank():
    # rank 1 prints `rank 1/4 pid 11272 ...` and its calibration line after the others, the same lines with other
    # numbers; rank 3 alone never prints its calibration line: the others waited for it
    assert verdict_and_root("qat_pctlhang_np4_r3_timeout") == ("hung", "hang.stopped_while_waiting", "hang", 3)


def test_output_that_stops_names_the_rank_that_went_on_past_the_line_the_others_ended_on():
    # a hand-made loop with `[rank N]` labels: every rank's `rank N: loaded .../sakt_init_e120.pt`, then rank 2's
    # `rank 2: rebuilding the interaction history of all 48 students ...`; no step, no stop line (230th batch)
    assert verdict_and_root("ktrace_slowhist_np4_r2_ranklabel") == ("hung", "hang.output_stopped", "hang", 2)
    # two agents behind pdsh-style host labels: rank 2's `filterbank cache stale, recomputing` (stop 44's known miss)
    assert verdict_and_root("wav_slowcache_np4_r2_pdsh2") == ("hung", "hang.output_stopped", "hang", 2)


def test_a_last_line_that_opens_as_the_others_do_is_no_going_on(tmp_path):
    # a clean run: ranks 0 and 1 end on `preview next event: note_on 48`, rank 2 on `... time_shift 16`: the same
    # message with another value, so no rank is named where the output stops (rank 0's save, which ends the run,
    # edited away so that the output stops there)
    report = edited_report("midi_none_np3_rnone_plain", "saved model to /tmp/job_work/music_final.pt",
                           "evaluating the held-out songs", tmp_path)
    assert report["verdict"] == "hung" and report["root_cause"]["rank"] is None


def test_the_rank_that_printed_its_work_after_the_others_timed_out_came_late():
    # ranks 0 and 1 time out in the step-2 all_reduce (`Timed out waiting 12000ms for recv`); rank 2 then prints
    # `rank 2 range coder: 420510 bytes` and loses its peers in the same all_reduce (cpu_adhoc 300th batch)
    assert verdict_and_root("limc_entropy_np3_r2_srunlabel") == ("failed", "gloo.timeout", "collective_timeout", 2)
    # one rank timed out (rank 1); ranks 0 and 2 lost their peers, and only rank 2 printed between (`rank 2 BPE
    # done: 5072760 merges`): the one that timed out was a waiter (301st batch)
    assert verdict_and_root("cint_bpe_np3_r2_srunlabel") == ("failed", "gloo.timeout", "collective_timeout", 2)


def test_without_a_line_of_work_the_closed_connection_after_the_timeouts_still_names_the_late_rank(tmp_path):
    # rank 2's line of work edited away: its only error is still a peer's closed connection printed after both
    # other ranks timed out, so it arrived after they gave up (test_lone_and_late_ranks.py has the same evidence
    # printed before the timeouts, which names no rank)
    report = edited_report("limc_entropy_np3_r2_srunlabel", "2: rank 2 range coder: 420510 bytes\n", "", tmp_path)
    assert report["root_cause"]["rank"] == 2
    assert any("after all of those timeouts" in reason for reason in report["root_cause"]["reasons"])


def test_of_the_ranks_that_never_joined_the_one_that_went_on_to_other_work_is_named(tmp_path):
    # `--tee 3 --local-ranks-filter 0,1`: rank 0 times out in step 2's all_reduce; rank 1's last line is `rank 1
    # filtering negatives against 96 known quadruples`, rank 2 prints nothing (filtered); both stopped by the agent
    assert verdict_and_root("tkgr_slowneg_np3_r1_filter") == ("failed", "gloo.timeout", "collective_timeout", 1)
    report = edited_report("tkgr_slowneg_np3_r1_filter",
                           "[default1]:rank 1 filtering negatives against 96 known quadruples\n", "", tmp_path)
    assert report["root_cause"]["rank"] is None and report["root_cause"]["ranks"] == [1, 2]
