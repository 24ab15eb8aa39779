"""Readings the 604th-607th batches of real CPU runs (torch 2.13, sample_logs/cpu_adhoc, labelled before triage ran)
asked for: mp.spawn reports the first child's error alone and terminates the rest, so one rank's timeout under it
says nothing of where the others were (the rank whose last line says it went on to other work is the one they
waited for); a store server that could not listen in init_process_group's own rendezvous is rank 0's, the only
rank that starts one there; and of the two ranks gloo's size check can mean, the one that printed a step no other
rank reached skipped a collective the others made."""

from __future__ import annotations

from sample_roots import edited_report, sample_report

SKIPPED = "kittiwake_skipbarrier_np5_r3_spawn"
WENT_ON = "rank 3 writing ledge summary"


def test_under_mp_spawn_the_rank_that_went_on_is_the_one_the_lone_timeout_waited_for():
    # mp.spawn, 5 ranks: every rank printed step 5, then rank 3 printed `rank 3 writing ledge summary` and skipped
    # the final barrier; process 0's barrier timed out and mp.spawn terminated the other four before they could
    # report theirs
    rc = sample_report(SKIPPED)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"], rc["exception_type"]) == (
        "gloo.timeout", "collective_timeout", 3, 67, "RuntimeError")
    assert any("mp.spawn reports the first child's error alone" in reason for reason in rc["reasons"])
    assert any("went on to other work" in reason for reason in rc["reasons"])
    assert not any("were all elsewhere together" in reason for reason in rc["reasons"])


def test_under_mp_spawn_without_a_rank_that_went_on_the_lone_timeout_stays_a_guess(tmp_path):
    # the same run with rank 3's last line a step line like every other rank's: nothing says who left, and the one
    # timeout mp.spawn printed is named, with less confidence and without claiming the others were elsewhere
    rc = edited_report(SKIPPED, WENT_ON, "rank 3 step 5 loss 4.9201 ledge_occupancy 2.2729", tmp_path)["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("gloo.timeout", 0)
    assert rc["confidence"] <= 0.35
    assert not any("were all elsewhere together" in reason for reason in rc["reasons"])


def test_under_mp_spawn_the_rank_that_skipped_a_barrier_can_be_the_one_that_timed_out():
    # mp.spawn, 4 ranks: rank 2 skipped the step-3 barrier and waited alone in the next all_reduce, and its
    # timeout is the one mp.spawn reported; every rank's last line is its step 2
    rc = sample_report("quahog_skip_barrier_np4_r2_spawn")["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["line"]) == ("gloo.timeout", 2, 47)


def test_a_store_server_that_could_not_listen_in_init_process_group_is_rank_0s():
    # a bash loop without prefixes, 5 ranks; a foreign socket held MASTER_PORT: one process's TCPStore server
    # failed with EADDRINUSE in `_create_c10d_store` (only rank 0 starts one), the others' clients timed out
    rc = sample_report("kittiwake_portinuse_np5_r0_bashloop")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("dist.port_in_use", "rendezvous", 0, 21)
    assert any("only rank 0 starts the rendezvous store's server" in reason for reason in rc["reasons"])


def test_torchruns_agent_store_names_no_worker_rank():
    # torchrun's agent hosts the store (its workers are all clients): the port clash is the agent's, before any
    # worker ran
    rc = sample_report("pipit_port_in_use_np4_rnone_torchrun")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("dist.port_in_use", "rendezvous", None, 44)


SKIPPED_REDUCE = "sandgrouse_skip_allreduce_np5_r2_torchrun"


def test_of_the_ranks_a_size_abort_can_mean_the_one_a_step_ahead_skipped_a_collective():
    # torchrun, 5 ranks, DDP: rank 2 skipped the step-3 metric all_reduce, printed step 3 alone and went on to the
    # gradient all_reduce; rank 1, the rank before it in the ring, received 40 bytes where it expected 4 and aborted
    rc = sample_report(SKIPPED_REDUCE)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == (
        "gloo.size_mismatch", "collective_mismatch", 2, 22)
    assert any("rank 2 printed step 3, a step no other rank reached" in reason for reason in rc["reasons"])


def test_a_size_abort_with_no_rank_ahead_names_the_aborting_rank_and_its_neighbour(tmp_path):
    # the same run without rank 2's step-3 line: every rank last printed step 2, and the report keeps the rank the
    # launcher saw fail, saying which neighbour to compare
    rc = edited_report(SKIPPED_REDUCE, "rank 2 step 3 loss 21.5336 water_ml 4.54", "", tmp_path)["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("gloo.size_mismatch", 1)
    assert any("the log cannot tell which" in reason for reason in rc["reasons"])


def test_a_bash_loops_rank_a_step_ahead_is_named_over_the_rank_the_others_waited_for():
    # a bash loop without prefixes, 3 ranks: rank 1 skipped a metric all_reduce and printed step 4 alone; rank 0
    # aborted on 68 bytes where it expected 4
    rc = sample_report("pingo_skip_allreduce_np3_r1_bashloop")["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["line"]) == ("gloo.size_mismatch", 1, 12)
