"""Readings the 620th-623rd batches of real CPU runs (torch 2.13, sample_logs/cpu_adhoc, labelled before triage ran)
asked for, of failures at the edges of a run: a KeyError raised in os.environ's lookup is an environment variable
unset in that process; a progress watchdog's words name the work or the thing that advances (`no foraging progress
for 4.3 s`); a point-to-point send and recv that never matched, while every rank has an error of its own, name the
pair and guess the sender; and a rank that met its peers' connections closed only after every timeout (its stop
handler's broadcast) did not wait with them: an unprefixed thread exception is that rank's."""

from __future__ import annotations

from logtriage.api import triage
from sample_roots import SAMPLES, edited_report, facts_of, sample_report


ENV = "ptarmigan_env_missing_np3_r2_srunlabel"


def test_a_keyerror_in_the_environments_lookup_is_an_unset_variable():
    # srun-style labels, 3 ranks: rank 2's `os.environ["PTARMIGAN_JOB_ID"]` raised in `<frozen os>` __getitem__
    report = sample_report(ENV)
    assert facts_of(report) == ("env.program_variable_unset", "environment", 2, 8, "KeyError")
    assert any("`PTARMIGAN_JOB_ID` is not set" in reason for reason in report["root_cause"]["reasons"])


def test_the_same_keyerror_raised_in_the_programs_own_lookup_stays_its_exception(tmp_path):
    report = edited_report(ENV, 'File "<frozen os>", line 679, in __getitem__',
                           'File "/tmp/job/fault621.py", line 90, in lookup', tmp_path)
    assert facts_of(report)[:3] == ("python.exception", "python_exception", 2)


def test_a_keyerror_from_the_environment_under_two_nodes_prefixes():
    # two torchrun agents as pdsh nodes: worker-1's rank 4 lacks NUMBAT_SITE_4
    assert facts_of(sample_report("numbat_envmissing_np6_r4_pdsh2"))[:3] == (
        "env.program_variable_unset", "environment", 4)


WATCHDOG = "numbat_watchdog_np8_r6_loglevel"


def test_a_watchdog_that_names_the_work_that_stopped_progressing():
    # LOGLEVEL=INFO torchrun, 8 ranks: `[watchdog rank 6] no foraging progress for 4.3 s, killing this process`,
    # then os._exit(6): the agent reports local_rank 6 exitcode 6
    assert facts_of(sample_report(WATCHDOG)) == ("hang.watchdog_heartbeat", "hang", 6, 44, None)


def test_without_the_watchdogs_words_the_exit_code_is_all_there_is(tmp_path):
    report = edited_report(WATCHDOG, "no foraging progress for 4.3 s, killing this process",
                           "foraging paused", tmp_path)
    assert facts_of(report)[:3] == ("signal.exit_nonzero", "unknown", 6)


P2P = "numbat_p2ptag_np4_r3_pymodule"


def test_an_unmatched_point_to_point_pair_names_its_sender():
    # python -m torch.distributed.run, 4 ranks: rank 3 isends to rank 0 with a tag rank 0's recv does not ask for;
    # rank 3 times out in its own `req.wait()` on the send, rank 0 in dist.recv, ranks 1-2 in the next all_reduce
    rc = sample_report(P2P)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["ranks"], rc["line"]) == (
        "gloo.timeout", "collective_timeout", 3, [3, 0], 54)
    assert rc["confidence"] < 0.5


def test_an_unmatched_pair_under_accelerate_whose_other_ranks_wait_in_ddps_backward():
    # accelerate launch, 5 ranks: rank 4's send timeout is inside DDP's backward (a ring), not its own send
    rc = sample_report("dikdik_p2p_np5_r2_acc")["root_cause"]
    assert (rc["rank"], rc["ranks"]) == (2, [2, 3])


def test_a_send_whose_receiver_stalled_silently_is_not_guessed_at():
    # 8 ranks in a pipeline: rank 5 stalled and printed nothing more; its sender rank 1 timed out in dist.send and
    # rank 0 in a recv: the sender is a victim, and the reading does not name it
    rc = sample_report("mp_hang_np8_r5_plain")["root_cause"]
    assert rc["rank"] != 1
    assert not any("point-to-point send of its own" in reason for reason in rc["reasons"])


def test_a_send_timeout_inside_a_collective_is_no_point_to_point_pair(tmp_path):
    # the same log with rank 3's wait on its send inside c10d's all_reduce: a ring's send, no unmatched pair
    report = edited_report(P2P, "[rank3]:     req.wait()\n",
                           "[rank3]:     dist.all_reduce(p.grad)\n[rank3]:   File \"/tmp/venv/lib/python3.11/site-packages"
                           "/torch/distributed/distributed_c10d.py\", line 3252, in all_reduce\n"
                           "[rank3]:     work.wait()\n", tmp_path)
    assert report["root_cause"]["rank"] != 3


THREAD = "bromeliad_thread_exc_np5_r1_pltorchrun"


def test_an_unprefixed_thread_exception_belongs_to_the_rank_that_did_not_wait():
    # torchrun + Lightning, 5 ranks: `Exception in thread pool-prefetch-1` (no prefix), rank 1 then blocked on the
    # thread's queue; ranks 0, 2, 3, 4 timed out; rank 1, told to stop, lost its peers in Lightning's SIGTERM handler
    report = sample_report(THREAD)
    assert facts_of(report) == ("python.exception", "python_exception", 1, 36, "RuntimeError")
    assert any("waited for rank 1" in reason for reason in report["root_cause"]["reasons"])


def test_a_rank_that_lost_its_peers_before_the_timeouts_waited_with_them(tmp_path):
    # the same log with rank 1's lost connection printed before the others' timeouts: it was waiting too, and the
    # thread's exception falls back to the rank the launcher saw fail first
    log = tmp_path / f"{THREAD}.moved.log"
    lines = (SAMPLES / f"{THREAD}.log").read_text().splitlines(keepends=True)
    own = [line for line in lines if line.startswith(("[rank1]:", "[rank: 1]"))]
    rest = [line for line in lines if line not in own]
    at = next(i for i, line in enumerate(rest) if line.startswith("[rank2]: Traceback"))
    log.write_text("".join(rest[:at] + own + rest[at:]))
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert (rc["exception_type"], rc["rank"]) == ("RuntimeError", 2)
