"""Chained exceptions on one rank or all, failures that come late in long logs, and logging that only looks
wrong, on real CPU runs of torch 2.13 (sample_logs/cpu_adhoc, the 66th-69th batches, each labelled before
triage ran; the test names the run)."""

from __future__ import annotations

import pytest

from logtriage.api import triage
from logtriage.demux.frames import TracebackFacts, watch_traceback_line

from sample_roots import SAMPLES
from sample_roots import root_cause as _root


def _handler_failed(lines: list[str]) -> bool:
    state: dict = {}
    for line in lines:
        watch_traceback_line(state, line, bare=False)
    facts = TracebackFacts()
    facts.record(1, state)
    return 1 in facts.handler_calls_failed


FIRST = ["Traceback (most recent call last):", '  File "/tmp/job/train.py", line 137, in fail',
         '    _ = batch["inputs"][idx]', "IndexError: index 9 is out of bounds for dimension 0 with size 8", "",
         "During handling of the above exception, another exception occurred:", "",
         "Traceback (most recent call last):", '  File "/tmp/job/train.py", line 177, in main', "    fail(step)",
         '  File "/tmp/job/train.py", line 139, in fail']


def test_a_finally_blocks_own_call_failing_is_the_handlers_failure_not_a_re_raise():
    # (the second exception in the same function, on a line that calls something: `os.remove(spill)`)
    assert _handler_failed(FIRST + ["    os.remove(spill)", "FileNotFoundError: [Errno 2] No such file or directory"])
    # (a library's `except KeyError: raise ValueError(...)` in the same function is its plainer error)
    assert not _handler_failed(FIRST + ['    raise ValueError("bad index") from None', "ValueError: bad index"])


@pytest.mark.parametrize("slug, rank, line, kind", [
    # rank 0's IndexError, then its finally block's os.remove of a spill file that is not there
    ("chain_finally_np4_r0_plain", 0, 17, "IndexError"),
    # the same `raise RuntimeError(...) from err` chain on all six ranks of two srun nodes: the KeyError
    # that started each chain ended its rank as much as the RuntimeError it raised
    ("chain_every_np6_rall_srun", 0, 28, "KeyError"),
])
def test_a_chain_is_read_by_the_exception_that_started_it(slug, rank, line, kind):
    rc = _root(slug)
    assert (rc["rule_id"], rc["rank"], rc["line"], rc["exception_type"]) == ("python.exception", rank, line, kind)


@pytest.mark.parametrize("slug, rank", [
    ("late_drift_np4_r3_plain", 3),   # ranks 0-2 time out in DDP's backward; rank 3 only sees them leave
    ("late_drift_np4_r1_pdsh", 1),    # the same over two emulated nodes
])
def test_the_one_rank_that_did_not_time_out_among_three_waiters_came_late(slug, rank):
    rc = _root(slug)
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("gloo.timeout", "collective_timeout", rank)


@pytest.mark.parametrize("slug, rank, line", [
    # rank 0 logs a caught FileNotFoundError with logger.exception ("using uniform weights") and its own
    # later records are stamped after it: it went on; rank 2's KeyError at step 5 is the root
    ("logging_logexc_np4_r2_plain", 2, 33),
    ("logging_logexc_np6_r3_srun", 3, 48),
])
def test_an_error_a_rank_logged_before_its_own_later_stamped_progress_was_lived_through(slug, rank, line):
    rc = _root(slug)
    assert (rc["rule_id"], rc["rank"], rc["line"], rc["exception_type"]) == ("python.exception", rank, line, "KeyError")


def test_an_empty_pickle_outside_any_checkpoint_code_is_the_programs_own_file():
    # `pickle.load(fh)` of an empty cached batch in the script's `batch()`: no torch.load, no checkpoint frame
    rc = _root("logging_stderrmix_np4_r2_plain")
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["exception_type"]) == (
        "python.exception", "python_exception", 2, "EOFError")


@pytest.mark.parametrize("slug, expected", [
    # job A holds `dataset.lock`; job B's rank 0 gives up: `filelock._core._errors.Timeout` (a private module
    # of exceptions, `_errors`, names the type)
    ("twojobs_lock_np4_r0_plain", ("host.file_lock", "environment", 0, 21, "filelock._core._errors.Timeout")),
    # both jobs create the shared-memory block `/fault71_batches`: FileExistsError in shared_memory.py
    ("twojobs_shm_np4_r0_plain", ("host.shm_name_taken", "environment", 0, 15, "FileExistsError")),
])
def test_two_jobs_on_one_machine(slug, expected):
    rc = _root(slug)
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"], rc["exception_type"]) == expected


def test_a_job_that_names_itself_before_its_ranks_done_lines_finished():
    report = triage([str(SAMPLES / "twojobs_ctrl_np4_rnone_plain.log")]).to_dict()
    assert (report["verdict"], report["root_cause"]) == ("ok", None)
