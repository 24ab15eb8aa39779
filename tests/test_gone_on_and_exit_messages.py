"""Readings the 612th-615th batches of real CPU runs (torch 2.13, sample_logs/cpu_adhoc, labelled before triage ran)
asked for: an ERROR record that says it put a value in place of what failed (`...; using default 0.5`) is an error
the program went on from, and so is the traceback logged under it; and the words a rank left before it exited
(`sys.exit(message)`) say why, also where they name what was aborted before the reason
(`meadow survey aborted, no edelweiss readings left ...`), or name the rank only in their text."""

from __future__ import annotations

from sample_roots import edited_report, root_facts, sample_report

CAUGHT = "hoodoo_caught_then_fail_np5_r4_srunlabel"
RECORD = "hardness lookup failed for a batch on rank 4, using default 0.5"


def test_a_traceback_logged_under_a_record_that_uses_a_default_was_gone_on_from():
    # srun-style labels, 5 ranks: rank 4 logged `ERROR:hoodoo:hardness lookup failed ..., using default 0.5` and a
    # KeyError traceback under it, then trained on to step 3; rank 0's missing shard ended the run at step 4
    assert root_facts(CAUGHT) == ("data.file_not_found", "python_exception", 0, 43, "FileNotFoundError")


def test_the_same_record_without_its_default_is_the_first_failure(tmp_path):
    # without the words that say it went on, the logged KeyError is rank 4's first error, before rank 0's
    rc = edited_report(CAUGHT, RECORD, "hardness lookup failed for a batch on rank 4", tmp_path)["root_cause"]
    assert (rc["rank"], rc["exception_type"]) == (4, "KeyError")


def test_a_loggers_record_that_uses_a_number_in_place_was_gone_on_from():
    # torchrun LOGLEVEL=INFO, 5 ranks: `ERROR:murrelet:nest ratio for step 1 failed; using 0.0` and a
    # ZeroDivisionError traceback with no rank, then every rank's steps; rank 3's missing extra shard ended the run
    rc = sample_report("murrelet_caught_then_np5_r3_loglevel")["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["line"], rc["exception_type"]) == (
        "data.file_not_found", 3, 81, "FileNotFoundError")


EXITED = "edelweiss_sys_exit_np4_r3_plbashloop"


def test_a_rank_that_left_without_a_traceback_said_what_it_aborted_and_why():
    # a bash loop, 4 ranks: rank 3 called sys.exit("rank 3: meadow survey aborted, no edelweiss readings left in
    # shard at step 3"); its peers lost their connections, and no launcher line holds its exit code
    rc = sample_report(EXITED)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == (
        "python.logged_error", "python_exception", 3, 32)
    assert not any("without a message" in reason for reason in rc["reasons"])


def test_a_rank_line_that_says_nothing_was_aborted_leaves_the_silent_exit(tmp_path):
    rc = edited_report(EXITED, "meadow survey aborted, no", "meadow survey at step, no", tmp_path)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("signal.exit_nonzero", "unknown", 3)


GAVE_UP = "hoodoo_sys_exit_np4_r0_pdsh2"


def test_an_exit_message_that_names_its_rank_only_in_its_words_is_that_ranks():
    # two torchrun agents as pdsh nodes: `worker-0: hoodoo rank 0: caprock table exhausted at step 2, giving up`
    # (no rank marker at its head), then worker-0's agent reports rank 0's exit code 1
    rc = sample_report(GAVE_UP)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == (
        "python.logged_error", "python_exception", 0, 6)


def test_an_exit_message_that_names_another_rank_is_not_the_exiting_ranks(tmp_path):
    rc = edited_report(GAVE_UP, "hoodoo rank 0: caprock", "hoodoo rank 2: caprock", tmp_path)["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("signal.exit_nonzero", 0)
