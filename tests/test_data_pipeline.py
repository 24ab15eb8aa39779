"""Readings the 628th-631st batches of real CPU runs (torch 2.13, sample_logs/cpu_adhoc, labelled before triage ran)
asked for, of the data pipeline: a file a DataLoader worker could not find is data (the worker only reads the
Dataset's files), whatever its name says; and a rank's DataLoader worker `killed by signal: Terminated` was reached
by the launcher's SIGTERM to the rank's process group, teardown, not a worker that died on its own."""

from __future__ import annotations

from sample_roots import edited_report, facts_of, sample_report


REMOVED = "mesquite_file_removed_np3_r2_bashloop"
WORKER = "Caught FileNotFoundError in DataLoader worker process 0."


def test_a_file_a_dataloader_worker_could_not_find_is_data():
    # a bash loop with rank prefixes, 3 ranks: rank 2's scratch JSONL file was removed while the job ran; its worker
    # raised `[Errno 2] No such file or directory: '/tmp/job_work/scratch_r2_6237.jsonl'`, a name with no data word
    report = sample_report(REMOVED)
    assert facts_of(report) == ("data.file_not_found", "python_exception", 2, 52, "FileNotFoundError")
    assert any("DataLoader worker" in reason for reason in report["root_cause"]["reasons"])


def test_the_same_missing_file_read_by_the_rank_itself_is_any_missing_file(tmp_path):
    report = edited_report(REMOVED, WORKER, "Caught FileNotFoundError in the reader.", tmp_path)
    assert facts_of(report)[:3] == ("python.file_not_found", "python_exception", 2)


STALL = "corella_stall_np3_r2_pltorchrun"


def test_a_worker_terminated_with_its_rank_is_teardown():
    # torchrun + Lightning, 3 ranks: rank 2 slept in step 3; ranks 0 and 1 timed out in DDP's all-reduce; the agent's
    # SIGTERM then reached rank 2's DataLoader worker (`is killed by signal: Terminated.`)
    assert facts_of(sample_report(STALL))[:3] == ("gloo.timeout", "collective_timeout", 2)


def test_a_worker_killed_by_another_signal_is_the_workers_death(tmp_path):
    report = edited_report(STALL, "is killed by signal: Terminated.", "is killed by signal: Killed.", tmp_path)
    assert facts_of(report)[:3] == ("data.loader_worker_died", "crash_signal", 2)
