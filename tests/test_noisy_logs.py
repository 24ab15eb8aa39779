"""Readings the 648th-651st batches of real CPU runs (torch 2.13, sample_logs/cpu_adhoc, labelled before triage ran)
asked for, of faults hidden in long, noisy logs: Python's faulthandler dumps (`dump_traceback_later`, whose default
is not to exit) followed by the ranks' collective timeouts were reports, not a watchdog's exit; the timeouts end the
run, and the one rank whose dump shows it in its own code, not torch's, is the rank the others waited for."""

from __future__ import annotations

from sample_roots import edited_report, facts_of, sample_report

DUMPED = "galago_fh_stall_np5_r2_tee"
RANK2_FRAME = '[default2]:  File "/work/main/sample_logs/cpu_adhoc/fault648.py", line 222 in main'


def test_dumps_followed_by_timeouts_are_reports_and_the_own_code_dump_names_the_stall():
    # torchrun --tee 3, 5 ranks: faulthandler.dump_traceback_later(5) on every rank; rank 2 slept at step 3, so
    # at 5 s four dumps show all_reduce and rank 2's its own `main` (fault648.py line 222); at 12 s the others time
    # out in gloo
    report = sample_report(DUMPED)
    assert facts_of(report) == ("gloo.timeout", "collective_timeout", 2, 389, "RuntimeError")
    assert any("own code (`main at fault648.py:222`)" in reason for reason in report["root_cause"]["reasons"])


def test_only_the_stalled_rank_dumped_in_a_lightning_step():
    # Lightning under torchrun --tee 3, 5 ranks: only rank 2's dump fired (in its own `before`), the others timed out
    # in DDP's backward
    assert facts_of(sample_report("palsa_stall_fh_np5_r2_pltee")) == ("gloo.timeout", "collective_timeout", 2, 534,
                                                                       "RuntimeError")


def test_with_every_dump_in_torch_the_timeouts_reading_names_the_rank(tmp_path):
    # rank 2's dump edited into all_reduce like the others': the dumps no longer tell, the timeouts still do
    report = edited_report(DUMPED, RANK2_FRAME, '[default2]:  File "/tmp/venv/lib/python3.11/site-packages/torch/'
                           'distributed/distributed_c10d.py", line 3252 in all_reduce', tmp_path)
    reasons = report["root_cause"]["reasons"]
    assert facts_of(report)[:3] == ("gloo.timeout", "collective_timeout", 2)
    assert not any("own code" in reason for reason in reasons) and "dumps were reports" in reasons[0]


def test_a_dump_that_exited_its_rank_stays_the_watchdogs_reading():
    # faulthandler.dump_traceback_later(3, exit=True): rank 2's dump ended it, its peers only lost their connection
    assert facts_of(sample_report("fh_watchdog_np4_r2"))[:3] == ("hang.watchdog_heartbeat", "hang", 2)
