"""Trainer callbacks, profilers, and the batches after them, on real CPU runs of torch 2.13
(sample_logs/cpu_adhoc, the 78th batch on, each labelled before triage ran; the test names the run)."""

from __future__ import annotations

from pathlib import Path

from logtriage.analysis.early_stop import _STOPPED_EARLY
from logtriage.api import triage

SAMPLES = Path(__file__).resolve().parent.parent / "sample_logs" / "cpu_adhoc"


def _report(slug: str) -> dict:
    return triage([str(SAMPLES / f"{slug}.log")]).to_dict()


def test_a_rank_that_stopped_early_alone_left_its_one_peer_waiting():
    # two ranks: rank 1's EarlyStopping fires on its own metric, it prints `stopping at epoch 1` and `done` and
    # exits 0; rank 0 goes on into epoch 2's all-reduce and loses its peer
    rc = _report("cb_earlyexit_np2_r1_plain")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("gloo.connection_closed", "collective_error", 1)
    assert any("stopped early" in reason for reason in rc["reasons"])


def test_only_a_stop_the_rank_took_itself_reads_as_stopping_early():
    assert _STOPPED_EARLY.search("rank 1: EarlyStopping: val_loss 1.3669 did not improve by 0.5, stopping at epoch 1")
    assert _STOPPED_EARLY.search("early stop triggered at step 40")
    assert _STOPPED_EARLY.search("rank 3 stopped early: budget spent")
    assert not _STOPPED_EARLY.search("rank 1 done")
    assert not _STOPPED_EARLY.search("stopping workers")
    assert not _STOPPED_EARLY.search("Stopping worker group")


def test_the_profilers_caught_bad_alloc_before_a_native_crash_is_host_memory():
    # rank 1 profiles with profile_memory=True under RLIMIT_AS: RecordFunction callbacks log
    # `Exception in RecordFunction callback: std::bad_alloc` as [W] warnings, then the rank dies of SIGSEGV
    rc = _report("prof_profmem_np3_r1_plain")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("host.memory_error", "host_oom", 1, 1509)


def test_among_ranks_sharing_an_error_the_one_that_lost_no_peer_before_it_went_first():
    # rank 2's non-critical metrics callback fails (caught, logged) so it skips the all-reduce, and its critical
    # callback raises KeyError 'val_loss_global'; ranks 1 and 3 log a caught `Connection closed by peer` in the
    # all-reduce, then raise the same KeyError
    rc = _report("cb_caughtsync_np4_r2_plain")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"], rc["exception_type"]) == (
        "python.exception", "python_exception", 2, 39, "KeyError")
