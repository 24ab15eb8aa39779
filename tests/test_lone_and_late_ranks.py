"""A stop that only one rank of a hung run answered: Lightning's handler prints `[rank: N] Received SIGTERM: 15`
only on a rank that is running Python, so the ranks waiting in a collective stay silent and the one that answers
is the rank the run hung on. And a rank that arrived at a collective after every other rank had timed out in it:
its only error is their closed connection, printed after their timeouts. Real CPU runs of torch 2.13 and Lightning
2.6.6 (sample_logs/cpu_adhoc, the 348th, 349th and 369th batches, labelled before triage ran)."""

from __future__ import annotations

from logtriage.api import triage
from sample_roots import SAMPLES, edited_report, root_facts, verdict_and_root

NOTICE = "[rank: 2] Received SIGTERM: 15\n"


def test_the_one_rank_that_answered_the_agents_stop_is_where_the_run_hung():
    # torchrun --tee 3 cut by `timeout`: every rank printed step 2, the agent passed SIGTERM on, and only rank 1
    # (stuck in a Python loop) printed Lightning's notice, after the agent's teardown began
    assert verdict_and_root("ocrl_stuck_np3_r1_pltee") == ("hung", "hang.stopped_while_waiting", "hang", 1)


def test_a_lone_notice_that_ends_the_log_is_a_hang_not_a_preemption():
    # a bash loop of four ranks, no launcher: all printed step 1, the loop's SIGTERM reached every rank and only
    # rank 2 (stuck before step 2's reduce) answered; nothing follows the notice
    assert verdict_and_root("pfam_msa_np4_r2_plbashloop") == ("hung", "hang.stopped_while_waiting", "hang", 2)


def test_every_rank_answering_is_a_stop_of_a_live_job(tmp_path):
    # the same run had every rank been running Python: each answers, nothing points at one
    every = "".join(f"[rank: {r}] Received SIGTERM: 15\n" for r in (0, 1, 3)) + NOTICE
    rc = edited_report("pfam_msa_np4_r2_plbashloop", NOTICE, every, tmp_path)["root_cause"]
    assert rc["category"] == "external_stop"


def test_a_lone_notice_with_output_after_it_stays_a_stop(tmp_path):
    # a rank that went on printing after the notice: the log does not end in the wait
    report = edited_report("pfam_msa_np4_r2_plbashloop", NOTICE, NOTICE + "rank 0 step 2 loss 2.0880 acc 0.109\n",
                           tmp_path)
    assert (report["verdict"], report["root_cause"]["category"], report["root_cause"]["rank"]) == (
        "failed", "external_stop", 2)


def test_two_ranks_answering_name_no_rank(tmp_path):
    rc = edited_report("ocrl_stuck_np3_r1_pltee", "[default1]:[rank: 1] Received SIGTERM: 15",
                       "[default1]:[rank: 1] Received SIGTERM: 15\n[default0]:[rank: 0] Received SIGTERM: 15",
                       tmp_path)["root_cause"]
    assert (rc["category"], rc["rank"]) == ("hang", None)


def test_the_rank_that_met_closed_connections_after_every_other_timed_out_arrived_late():
    # Lightning in a bash loop, 3 ranks: rank 2 spends ~30 s in Python after step 2; ranks 0 and 1 raise `Timed out
    # waiting 12000ms` (recv, send) in the reduce, then rank 2's traceback ends in `Connection closed by peer`
    assert root_facts("rxnc_slow_np3_r2_plbashloop")[:3] == ("gloo.timeout", "collective_timeout", 2)


def test_a_closed_connection_printed_before_the_timeouts_is_no_late_arrival(tmp_path):
    # the same lines with rank 2's traceback moved before the others' timeouts: it met the closed connection while
    # they still waited, so it was in the collective with them, and nothing tells the three apart
    lines = (SAMPLES / "rxnc_slow_np3_r2_plbashloop.log").read_text().splitlines(keepends=True)
    own = [i for i, line in enumerate(lines) if line.startswith("[rank2]:")]
    first_wait = next(i for i, line in enumerate(lines) if line.startswith("[rank0]:"))
    rest = lines[:own[0]] + lines[own[-1] + 1:]
    log = tmp_path / "moved.log"
    log.write_text("".join(rest[:first_wait] + lines[own[0]:own[-1] + 1] + rest[first_wait:]))
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert (rc["category"], rc["rank"]) == ("collective_timeout", None)
