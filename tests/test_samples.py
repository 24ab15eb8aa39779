"""Every captured log with an expectation sidecar gets the expected diagnosis (its lines are conserved,
line by line: test_conservation.py)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from logtriage.api import TriageOptions, triage
from logtriage.demux.clean import clean, decode
from logtriage.demux.prefixes import Dialect
from logtriage.regress.cases import compare, find_cases
from tests.conftest import SAMPLES

CASES = find_cases(SAMPLES)
UNREVIEWED = "UNREVIEWED"   # marker file of a held-out folder whose measurement the lead has not reviewed


def test_there_are_samples_of_every_kind():
    kinds = {case.name.split("/", 1)[0] for case in CASES}
    assert {"cpu", "public"} <= kinds
    assert len(CASES) >= 60


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_sample_diagnosis(case):
    report = triage([str(path) for path in case.inputs], TriageOptions()).to_dict()
    problems = compare(case.expectation, report)
    if problems and case.expectation.known_miss:
        pytest.xfail(case.expectation.known_miss)
    if problems and (case.log.parent / UNREVIEWED).exists():
        # a held-out set still being collected: its labels are measured first, then reviewed
        pytest.xfail(f"held-out set not yet reviewed: {'; '.join(problems)}")
    assert problems == []
    assert not case.expectation.known_miss, "diagnosed right now: drop its known_miss"
    rc = report["root_cause"]
    if case.expectation.verdict != "ok":
        assert rc is not None
    if rc is not None and rc["line"] is not None:
        # the root line is a real line of this case's input, and its text is that line's
        source = Path(rc["source"])
        assert source in case.inputs or case.log in source.parents
        rows = source.read_bytes().split(b"\n")
        line = clean(decode(rows[rc["line"] - 1]))
        if rc["text"] not in line:
            # a hard-wrapped paste: the line goes on in the rows after it (demux/wrapped.py)
            width = Dialect.detect(clean(decode(row)) for row in rows[:4000]).wrap_width
            assert width and len(line) == width
            assert rc["text"] in "".join(clean(decode(row)) for row in rows[rc["line"] - 1:rc["line"] + 40])


# Labels that name another rule than the catalog's for the same failure (each console case says so in its
# known_miss): the program's own FloatingPointError over its loss is numerical.checked_nonfinite's, where some
# labels name numerical.loss_nan (and older ones the other way); a missing file that is data by its name is
# data.file_not_found's, where some labels name the generic python.file_not_found (and some the other way);
# a FileNotFoundError a label gives the generic python.exception is python.file_not_found's.
RULE_CONVENTIONS = frozenset({("numerical.checked_nonfinite", "numerical.loss_nan"),
                              ("numerical.loss_nan", "numerical.checked_nonfinite"),
                              ("data.file_not_found", "python.file_not_found"),
                              ("python.file_not_found", "data.file_not_found"),
                              ("python.exception", "python.file_not_found")})


# The folder holds only what the ranks wrote: a signal or a bare exit code is known from the
# agent's console lines alone, so those runs are left out.
LOG_DIRS = [c for c in CASES if c.log.is_file() and c.log.with_suffix("").is_dir()
            and not (c.expectation.rule or "").startswith("signal.") and c.expectation.category != "crash_signal"]


def _log_dir_known_miss(case) -> str:
    """Why the folder, too, misses the label (`log_dir_known_miss = "..."` in the case's expect file), if it does."""
    return str(tomllib.loads(case.expect_path.read_text()).get("log_dir_known_miss", ""))


@pytest.mark.parametrize("case", LOG_DIRS, ids=[c.name for c in LOG_DIRS])
def test_log_dir_copy_names_the_same_root(case):
    """A run captured with `--log-dir` has a folder of per-rank files beside its console log: the
    folder alone must give the same root cause (each file's tracebacks stay its own: block ids
    once restarted per file, so rank 1's traceback merged with rank 0's and lost to its gloo error)."""
    report = triage([str(case.log.with_suffix(""))], TriageOptions()).to_dict()
    rc, want = report["root_cause"], case.expectation
    if want.verdict == "ok":    # a control run's folder: every rank's steps and its result, no failure
        assert (report["verdict"], rc) == ("ok", None)
        return
    wrong_rank = want.rank is not None and rc["rank"] != want.rank
    if (why := _log_dir_known_miss(case)) and (rc["category"] != want.category or wrong_rank):
        pytest.xfail(why)
    assert rc["category"] == want.category
    # (a label that names no rule leaves the rule open, as compare() does; one that names the console's own reading
    # of an exit 1 whose output went to files leaves it open too: the folder holds that traceback itself)
    if want.rule is not None and want.rule != "python.exit_one_output_elsewhere":
        assert rc["rule_id"] == want.rule or (want.rule, rc["rule_id"]) in RULE_CONVENTIONS
    if want.exception_type is not None:
        assert rc["exception_type"].rsplit(".", 1)[-1] == want.exception_type.rsplit(".", 1)[-1]
    assert rc["source"].startswith(str(case.log.with_suffix("")))
    if want.rank is not None and want.rule != "dist.collective_mismatch":
        # two ranks that each report the other's mismatch have no odd one out, and separate
        # files say nothing about which rank printed first
        assert rc["rank"] == want.rank


def test_a_log_dir_case_reads_the_console_kept_beside_it(tmp_path):
    # `--redirects 3 --log-dir`: the console holds only the agent's lines (a worker's signal), the
    # folder only what the ranks wrote (sample_logs/cpu_adhoc/sigtrap_np6_r5_redirects)
    folder = tmp_path / "sig_redirects" / "none_x" / "attempt_0"
    for rank in (0, 1):
        (folder / str(rank)).mkdir(parents=True)
        (folder / str(rank) / "stdout.log").write_text(f"rank {rank} step 2\n")
    (tmp_path / "sig_redirects.console.log").write_text(
        "E1201 23:30:01.000000 77 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -5) "
        "local_rank: 1 (pid: 79) of binary: /tmp/venv/bin/python3\n")
    (tmp_path / "sig_redirects.expect.toml").write_text(
        'verdict = "failed"\ncategory = "crash_signal"\nrule = "signal.other_signal"\nrank = 1\n')
    (case,) = find_cases(tmp_path)
    assert case.inputs == (tmp_path / "sig_redirects", tmp_path / "sig_redirects.console.log")
    report = triage([str(path) for path in case.inputs], TriageOptions()).to_dict()
    assert compare(case.expectation, report) == []
    # the folder alone cannot say it: the signal is only in the console
    assert compare(case.expectation, triage([str(case.log)], TriageOptions()).to_dict()) != []
