"""A logging format whose bracket holds the program's name before the rank, and an error line that names its
rank later in the message (stop 55's and stop 56's batches), and a clean run's
last line that says it wrote its export:

- `2026-12-06 19:43:54,065 [evch rank 3] ERROR training failed` (cpu_adhoc 493rd batch): `[<word> rank N]` is the
  line's rank, as `[rank N]` and `[global rank N]` are, so the slow rank that made its peers time out is named;
- `ERROR: tile grid misaligned: orthomosaic tile (41, 17) of rank 1 is offset 3.2 m from the GCP grid` (497th) and
  `ERROR: holiday calendar ... not found on rank 2; ...` (489th), each the last line of a rank's own file before
  `sys.exit(4)`: the script's logged error, not a bare exit code;
- `ERROR mead_monitor: rank 4 hydrometer calibration drift ...` (500th), the rank with no colon after it, before a
  restarted attempt's own failure to connect: the logged error, with no exception type borrowed from that
  attempt's traceback;
- `ERROR refractometer calibration drift on rank 2: ...` (507th): the level bare, the rank inside the message;
- `rank 0 wrote export /tmp/job_work/vole_forecaster_export.pt` (501st) or `export written to ...` (507th) as a
  clean run's last line: the run ended on its result, it did not hang;
- a hang where one rank's last progress line is one step short of all the others' (507th): that rank is behind."""

from __future__ import annotations

import numpy as np
import pytest

from logtriage.api import triage
from logtriage.demux.line_marks import find_rank_marker
from logtriage.fastscan.kernel_markers import marker
from sample_roots import SAMPLES, edited_report, root_cause, root_facts, sample_report


@pytest.mark.parametrize("text, rank", [
    ("2026-12-06 19:43:54,065 [evch rank 3] ERROR training failed", 3),
    ("[trainer.v2-a rank 5/8] step 1", 5),
    ("[global rank 2] step 1", 2),
    ("[rank 4] step 1", 4),
    ("[a b rank 9] two words are not a program's name", None),
    ("[1abc rank 3] a name starts with a letter", None),
    ("[" + "w" * 33 + " rank 7] at most 32 characters", None),
])
def test_a_program_name_in_the_bracket_before_the_rank(text, rank):
    buf = np.frombuffer(text.encode(), dtype=np.uint8)
    assert find_rank_marker(text) == rank
    # the fast path's kernel reads the same rank, or none
    assert marker(buf, 0, len(buf), np.zeros(8, dtype=np.int64)) == (-1 if rank is None else rank)


@pytest.mark.parametrize("slug, rule, category, rank, line", [
    # rank 2 slept in pure Python; its peers' gloo receives timed out first, their records named by the bracket
    ("evch_slow_rank_np4_r2_logfmt", "gloo.timeout", "collective_timeout", 2, 26),
    ("evch_worker_crash_np5_r3_logfmt", "data.loader_worker_died", "crash_signal", 3, 16),
])
def test_the_bracket_names_the_failing_rank(slug, rule, category, rank, line):
    assert root_facts(slug)[:4] == (rule, category, rank, line)


def test_without_the_program_name_the_bracket_still_names_it(tmp_path):
    report = edited_report("evch_slow_rank_np4_r2_logfmt", "[evch rank ", "[rank ", tmp_path)
    assert (report["root_cause"]["rule_id"], report["root_cause"]["rank"]) == ("gloo.timeout", 2)


@pytest.mark.parametrize("folder, rank", [
    ("lich_logged_exit_np5_r1_files", 1),
    ("subw_exit4_np6_r2_files", 2),
])
def test_an_error_line_naming_its_rank_is_the_logged_error(folder, rank):
    rc = triage([str(SAMPLES / folder)]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("python.logged_error", "python_exception",
                                                                       rank, 3)
    assert rc["source"].endswith(f"rank{rank}.log")


def test_an_error_line_naming_no_rank_leaves_the_exit_code(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    for log in (SAMPLES / "lich_logged_exit_np5_r1_files").glob("rank*.log"):
        (folder / log.name).write_text(log.read_text().replace(" of rank 1 is offset", " is offset"))
    rc = triage([str(folder)]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("signal.exit_nonzero", "unknown", 1)


def test_a_bare_level_then_a_message_naming_its_rank_is_the_logged_error():
    # `worker-0: ERROR refractometer calibration drift on rank 2: offset ...` of two agents as pdsh nodes (507th)
    assert root_facts("cider_logged_exit_np6_r2_pdsh2")[:4] == ("python.logged_error", "python_exception", 2, 26)


def test_a_logged_error_before_a_restart_keeps_no_borrowed_exception_type():
    assert root_facts("mead_logged_exit_np5_r4_restart") == ("python.logged_error", "python_exception", 4, 7, None)


def test_a_logged_error_with_its_traceback_right_after_is_that_exception(tmp_path):
    # logger.exception's traceback follows on the next line: the exception it shows is the root
    report = edited_report("mead_logged_exit_np5_r4_restart", "on uncalibrated readings\n",
                           "on uncalibrated readings\nTraceback (most recent call last):\n"
                           "  File \"/tmp/job/fault500.py\", line 140, in main\n"
                           "ValueError: calibration drift 0.0071\n", tmp_path)
    assert (report["root_cause"]["rule_id"], report["root_cause"]["exception_type"],
            report["root_cause"]["rank"]) == ("python.exception", "ValueError", 4)


@pytest.mark.parametrize("slug", ["vole_none_np4_rnone_bashloop",      # `rank 0 wrote export <path>`
                                  "cider_none_np3_rnone_bashloop",     # `export written to <path>` (507th)
                                  "krill_none_np4_rnone_plain"])       # `rank 0 saved export` (508th)
def test_a_clean_run_ending_on_the_export_it_wrote_is_ok(slug):
    assert sample_report(slug)["verdict"] == "ok"


def test_without_its_export_line_the_same_output_has_stopped(tmp_path):
    report = edited_report("vole_none_np4_rnone_bashloop", "rank 0 wrote export", "rank 0 reading export", tmp_path)
    assert (report["verdict"], report["root_cause"]["rule_id"]) == ("hung", "hang.output_stopped")


def test_a_lone_rank_one_step_short_of_all_the_others_is_behind():
    report = sample_report("cider_allreduce_size_np5_r2_spawn")
    assert (report["verdict"], report["root_cause"]["rule_id"], report["root_cause"]["rank"]) == \
        ("hung", "hang.no_progress", 2)


def test_two_ranks_one_step_short_are_ordinary_skew(tmp_path):
    report = edited_report("cider_allreduce_size_np5_r2_spawn", "rank 4 step 3 loss 1.6515",
                           "rank 4 step 2 loss 1.6515", tmp_path)
    assert (report["verdict"], report["root_cause"]["rule_id"], report["root_cause"]["rank"]) == \
        ("hung", "hang.output_stopped", None)
