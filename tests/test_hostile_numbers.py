"""Ranks past 2^31, 10,000 ranks, and numbers no rank can have: the demuxer turns a digit run into
an int only when it has at most 12 digits, so a log can neither crash int() (4300-digit limit)
nor put an integer too big for JSON into the report."""

from __future__ import annotations

import orjson
import pytest

from logtriage.api import run_triage
from logtriage.demux.launcher import LauncherFacts, py_glog_pid
from logtriage.demux.prefixes import Dialect, strip_prefixes
from logtriage.ingest.sources import _hints

HUGE = "9" * 5000


@pytest.mark.parametrize("line", [
    f"[1,{HUGE}]<stdout>: KeyError: 1",
    f"[{HUGE},3]<stdout>: KeyError: 1",
    f"[rank{HUGE}]: KeyError: 1",
    f"[default{HUGE}]:KeyError: 1",
    f"{HUGE}: KeyError: 1",
    f"[default|rank={HUGE}|local=1] KeyError: 1",
])
def test_prefix_with_a_5000_digit_rank_is_not_a_prefix(line):
    p = strip_prefixes(line, Dialect(srun=True))
    assert p.rank is None or p.rank < 10**12
    assert line.endswith(p.text)
    assert (p.rank, p.text) == (None, line)          # not a prefix at all: nothing is stripped


@pytest.mark.parametrize("line", [
    f"failed (exitcode: 1) local_rank: {HUGE} (pid: {HUGE}) of binary: /usr/bin/python",
    f"Sending process {HUGE} closing signal SIGTERM",
    f"Terminating process {HUGE} via signal SIGTERM",
    f"  rank      : {HUGE} (local_rank: {HUGE})",
    f"  exitcode  : -6 (pid: {HUGE})",
])
def test_launcher_line_with_huge_numbers_is_ignored(line):
    facts = LauncherFacts()
    facts.observe(line)
    assert facts.pid_to_rank() == {} and facts.teardown_pids == set() and facts.failed_lines == 0


@pytest.mark.parametrize("rank, pid, expected", [
    ("3", "100", {100: 3}),          # the control: a summary entry pairs its rank with its pid
    (HUGE, "100", {}),
    ("3", HUGE, {}),
])
def test_child_failed_entry_pairs_rank_and_pid_only_with_sane_numbers(rank, pid, expected):
    # the summary's `rank :` line only takes effect with the `exitcode :` line after it
    facts = LauncherFacts()
    facts.observe(f"  rank      : {rank} (local_rank: 0)")
    facts.observe(f"  exitcode  : -6 (pid: {pid})")
    assert facts.pid_to_rank() == expected


def test_glog_header_with_huge_pid_is_not_a_header():
    assert py_glog_pid(f"W1130 01:06:31.492000 {HUGE} torch/distributed/run.py:874] x") is None
    assert py_glog_pid("W1130 01:06:31.492000 19577 torch/distributed/run.py:874] x") == (19577, "torch/distributed/run.py")


def test_logdir_path_with_huge_numbers_names_no_rank():
    assert _hints(f"run/attempt_0/{'9' * 200}/stderr.log") == (None, None, None)
    assert _hints("run/attempt_1/3/stderr.log") == (3, 1, "stderr")


@pytest.mark.parametrize("rank", [2**31 - 1, 2**31, 2**31 + 7, 2**32 + 1, 10**12 - 1])
def test_ranks_past_2_to_the_31(tmp_path, rank):
    log = tmp_path / "big_ranks.log"
    log.write_text(f"[rank0]: step 1 loss 0.1\n[rank{rank}]: step 1 loss 0.1\n"
                   f"[rank{rank}]: Traceback (most recent call last):\n"
                   f'[rank{rank}]:   File "train.py", line 3, in <module>\n'
                   f"[rank{rank}]: KeyError: 'x'\n")
    report = orjson.loads(orjson.dumps(run_triage([str(log)]).report.to_dict()))
    assert report["verdict"] == "failed"
    assert report["root_cause"]["rank"] == rank
    assert report["root_cause"]["line"] == 5
    assert {r["rank"] for r in report["ranks"]} == {0, rank}


def test_ten_thousand_ranks(tmp_path):
    log = tmp_path / "r10k.log"
    ranks = 10_000
    with log.open("w") as out:
        for r in range(ranks):
            out.write(f"[rank{r}]: step 1 loss 0.1\n")
        out.write("[rank7777]: Traceback (most recent call last):\n[rank7777]: KeyError: 7\n")
        for r in range(ranks):
            if r != 7777:
                out.write(f"[rank{r}]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                          f"Connection closed by peer [127.0.0.1]:29500\n")
    run = run_triage([str(log)])
    report = run.report.to_dict()
    assert report["root_cause"]["rank"] == 7777
    assert report["root_cause"]["rule_id"] == "python.exception"
    assert len(report["ranks"]) == ranks
    assert report["input_lines"] == 2 * ranks + 1 == sum(s["lines"] for s in report["streams"])
    cascade = [c for c in report["chain"] if c["rule_id"] == "gloo.connection_closed"]
    assert cascade and cascade[0]["count"] == ranks - 1


_CFE_TEMPLATE = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
train.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_01:06:31
  host      : localhost
  rank      : {n} (local_rank: {n})
  exitcode  : -6 (pid: {n})
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID {n}
============================================================
"""


@pytest.mark.parametrize("digits", [30, 5000])
def test_child_failed_summary_with_huge_numbers(tmp_path, digits):
    log = tmp_path / "cfe.log"
    log.write_text(_CFE_TEMPLATE.format(n="9" * digits))
    report = run_triage([str(log)]).report
    orjson.loads(orjson.dumps(report.to_dict()))
    rc = report.root_cause
    # the numbers are dropped, not converted: no rank (a 1-digit one gives rank 1), the SIGABRT stays
    assert (report.verdict, rc.rule_id, rc.line, rc.rank, rc.ranks) == ("failed", "signal.sigabrt", 10, None, ())
