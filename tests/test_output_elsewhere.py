"""A torchrun console whose workers wrote to files (`--redirects 3 --log-dir`): the agent's start-up banner, its
teardown and the failure summary, and not one line of any worker (with `--tee 3 --local-ranks-filter`, only other
ranks' labelled lines). A worker's exit code 1 there is read as the interpreter's exit on an uncaught exception
(`python.exit_one_output_elsewhere`); a paste of the summary alone, another exit code, or a console that holds a line
no rank's label claims keeps the bare exit code. Real CPU runs of torch 2.13
(sample_logs/cpu_adhoc, labelled before triage ran; the test names the run)."""

from __future__ import annotations

import pytest

from logtriage.api import triage
from sample_roots import SAMPLES, edited_report, sample_report

BANNER = "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default"


@pytest.mark.parametrize("slug, rank, line", [
    # rank 2 cannot find its ratings file; the console: banner, two SIGTERMs, `failed (exitcode: 1) local_rank: 2`
    ("cdr_noratings_np3_r2_redirects", 2, 7),
    # the filter form: `--local-ranks-filter` kept no line of any worker either
    ("coll_beforeinit_np3_r2_filter", 2, None),
])
def test_exit_code_one_with_every_workers_output_elsewhere_is_a_python_exception(slug, rank, line):
    report = sample_report(slug)
    rc = report["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("python.exit_one_output_elsewhere", "python_exception", rank)
    assert rc["line"] == line or line is None
    assert report["unattributed_lines"] == 0 and all(r["lines"] == 0 for r in report["ranks"])


@pytest.mark.parametrize("slug, rank", [
    # `--tee 3 --local-ranks-filter 0`: ranks 0-6's lines all carry their `[defaultN]:` labels, none is rank 7's
    ("end_eval_key_np8_r7_filter", 7),
    ("io_rank0barrier_np3_r1_filter", 1),
])
def test_exit_code_one_of_a_rank_whose_lines_were_filtered_out_is_a_python_exception(slug, rank):
    report = sample_report(slug)
    rc = report["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("python.exit_one_output_elsewhere", "python_exception", rank)
    lines = {r["rank"]: r["lines"] for r in report["ranks"]}
    assert lines.get(rank, 0) == 0 and sum(lines.values()) > 0 and report["unattributed_lines"] == 0


def test_the_summary_alone_stays_an_exit_code(tmp_path):
    # a paste that starts at the ChildFailedError: nothing says where the workers' output went
    lines = (SAMPLES / "cdr_noratings_np3_r2_redirects.log").read_text().splitlines(keepends=True)
    start = next(i for i, text in enumerate(lines) if "ChildFailedError:" in text)
    log = tmp_path / "summary.log"
    log.write_text("".join(lines[start:]))
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("signal.exit_nonzero", "unknown", 2)


@pytest.mark.parametrize("old, new", [
    # another exit code: a script's own `sys.exit(3)`, not the interpreter's uncaught exception
    ("exitcode  : 1 (pid: 16922)", "exitcode  : 3 (pid: 16922)"),
    # a worker's line in the console: its output was not (all) elsewhere, and it printed no error
    (f"W1205 16:04:26.409000 16456 torch/distributed/run.py:874] {BANNER}",
     f"W1205 16:04:26.409000 16456 torch/distributed/run.py:874] {BANNER}\nrank 2 step 1 loss 0.93"),
])
def test_another_code_or_a_workers_line_keeps_the_exit_code(old, new, tmp_path):
    rc = edited_report("cdr_noratings_np3_r2_redirects", old, new, tmp_path)["root_cause"]
    assert rc["rule_id"] != "python.exit_one_output_elsewhere"
    assert rc["category"] == "unknown"

