"""Readings the 640th-643rd batches of real CPU runs (torch 2.13, sample_logs/cpu_adhoc, labelled before triage ran)
asked for, of faults in the side work around training: bash's notice of a job that SIGXFSZ ended ("File size limit
exceeded", run into the command it prints) is a signal death; and one rank that timed out in the store outside any
collective (its own store.get) while the others waited for it in a collective, or only lost their connection when it
left, is the rank whose handshake the others never made."""

from __future__ import annotations

from sample_roots import edited_report, facts_of, sample_report

XFSZ = "fynbos_metrics_sigxfsz_np3_r2_plbashloop"
OWN_KEY = "gharial_store_get_np5_r1_filter"
SPAWNED = "potoroo_store_get_np3_r1_spawn"


def test_bashs_notice_of_a_file_size_limit_is_a_signal_death():
    # Lightning under a bash loop, 3 ranks: rank 2 wrote its metrics under a 64-byte RLIMIT_FSIZE and SIGXFSZ killed
    # it; bash printed "bash: line 1:  6985 File size limit exceededMASTER_ADDR=... --rank 2"
    assert facts_of(sample_report(XFSZ))[:4] == ("signal.other_signal", "crash_signal", 2, 65)


def test_without_bashs_notice_the_silent_rank_is_an_exit_alone(tmp_path):
    report = edited_report(XFSZ, "6985 File size limit exceeded", "6985 ", tmp_path)
    assert facts_of(report)[:3] == ("signal.exit_nonzero", "unknown", 2)


def test_a_rank_waiting_alone_on_its_own_store_key_is_the_one_the_others_lost():
    # torchrun --tee 3 --local-ranks-filter 0,1, 5 ranks: rank 1's store.get("gharial_eval_done") raised
    # DistStoreError after 5 s; rank 0 then lost its connection; ranks 2-4 are filtered off the console
    assert facts_of(sample_report(OWN_KEY))[:3] == ("dist.store_wait_in_collective", "collective_timeout", 1)


def test_under_mp_spawn_the_rank_in_the_store_is_the_one_the_collective_waited_for():
    # mp.spawn, 3 ranks: rank 1's store wait logged c10d's socket timeout and never raised; rank 0's all_gather_object
    # send timed out (spawn's report); rank 2 printed nothing after its eval line
    assert facts_of(sample_report(SPAWNED))[:3] == ("dist.store_wait_in_collective", "collective_timeout", 1)


def test_with_two_ranks_in_the_store_the_rank_missing_from_the_waits_is_named(tmp_path):
    # rank 0's wait made a store wait too: both waited in the store, and rank 2, in neither, is the one they lack
    report = edited_report(SPAWNED, "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                           "unbound_buffer.cc:129] Timed out waiting 12000ms for send operation to complete",
                           "torch.distributed.DistStoreError: wait timeout after 12000ms, keys: /default_pg/0//map",
                           tmp_path)
    assert facts_of(report)[:3] == ("dist.store_wait_in_collective", "collective_timeout", 2)
