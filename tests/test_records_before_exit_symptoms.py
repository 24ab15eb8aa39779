"""A rank's own error record, then the C++ runtime's `terminate called without an active exception` as the
process dies on its way out (`sys.exit` with a thread still running): the record is the failure, the terminate
only how the process ended. A real CPU run of torch 2.13 (sample_logs/cpu_adhoc, the 218th batch, labelled
before triage ran)."""

from __future__ import annotations

from sample_roots import edited_report, root_facts


def test_an_error_record_is_not_taken_over_by_the_terminate_under_it():
    # `[default1]:ERROR rank 1: task 1 has 0 samples left after outlier filtering (32 read); cannot fit`, then
    # `[default1]:terminate called without an active exception`; the agent reports rank 1's SIGABRT
    assert root_facts("hnet_exit5_np3_r1_tee")[:4] == ("python.logged_error", "python_exception", 1, 23)


def test_without_the_record_the_terminate_is_the_ranks_end(tmp_path):
    report = edited_report("hnet_exit5_np3_r1_tee",
                           "ERROR rank 1: task 1 has 0 samples left after outlier filtering (32 read); cannot fit",
                           "rank 1 task 1 has 0 samples left after outlier filtering (32 read)", tmp_path)
    assert (report["root_cause"]["category"], report["root_cause"]["rank"]) == ("crash_signal", 1)
