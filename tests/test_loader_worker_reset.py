"""A DataLoader worker killed while the main process fetched its batch from shared memory: with the default
file_descriptor strategy the main process asks the worker's resource sharer for the batch's descriptor, and the
dead worker answers with a reset connection (`ConnectionResetError: [Errno 104] Connection reset by peer` in
multiprocessing's connection.py, below dataloader.py and resource_sharer.py), with no "DataLoader worker ... exited
unexpectedly" line (cpu_adhoc 500th and 508th batches). The worker's death is the root, on the rank that fetched."""

from __future__ import annotations

import pytest

from sample_roots import edited_report, root_facts


@pytest.mark.parametrize("slug, rank", [
    ("krill_worker_crash_np4_r3_wrapper", 3),
    ("mead_worker_crash_np5_r0_loglevel", 0),
])
def test_a_reset_from_the_workers_resource_sharer_is_the_workers_death(slug, rank):
    rule, category, got_rank, _, exception = root_facts(slug)
    assert (rule, category, got_rank, exception) == ("data.loader_worker_died", "crash_signal", rank,
                                                     "ConnectionResetError")


def test_a_reset_outside_the_dataloader_stays_the_exception(tmp_path):
    # the same traceback without the DataLoader's frames: a connection reset of the script's own
    report = edited_report("krill_worker_crash_np4_r3_wrapper", "torch/utils/data/dataloader.py",
                           "mypkg/feeder.py", tmp_path)
    rc = report["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("python.exception", "python_exception", 3)


def test_the_dataloaders_own_word_in_the_handling_is_the_root():
    # a transformers.Trainer run: the reset connection, then "During handling ..." the DataLoader's SIGCHLD handler
    # raising `RuntimeError: DataLoader worker (pid 8734) is killed by signal: Killed.` (cpu_adhoc 562nd batch)
    assert root_facts("larch_worker_crash_np4_r1_hf") == ("data.loader_worker_died", "crash_signal", 1, 71,
                                                          "RuntimeError")
