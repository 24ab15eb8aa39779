"""Readings of stop 57's second round (cpu_adhoc 520th-523rd batches).

A SIGTERM to the launcher (`timeout`) after every rank stepped on from its first progress line, nothing failed and
no rank printed progress after it: a stop that ended a hang, also where no line before it is stamped as the stop is
(`accelerate launch` prints no stamped banner; torchrun prints none when OMP_NUM_THREADS is set), so the time from
the start is unknown. Before, such a log read as a stop from outside (external_stop). Heartbeats at one step are not
steps on (tests/test_rootcause.py::test_two_heartbeats_are_not_yet_a_stall).

A control run's rank 0 that says it finished its run (`rank 0 finished quill stroke trainer run`) after the Trainer's
records: the program ended, the run is ok.

A script's own ERROR line with the program's name in the rank's brackets, or with no rank but ending on its giving
up (`...; aborting`): python.logged_error."""

from __future__ import annotations

import pytest

from logtriage.analysis.signed_off import SIGNED_OFF
from logtriage.api import triage
from sample_roots import SAMPLES, sample_report


@pytest.mark.parametrize("slug, rank", [
    ("quill_slow_np3_r2_acc", None),                 # accelerate launch: no stamped line before the stop
    ("sluice_slowgate_np3_r2_pltorchrun", 2),        # only rank 2's handler answered the SIGTERM
    ("bonsai_hang_np3_r1_acc", None),
])
def test_a_stampless_stop_after_every_ranks_steps_ended_a_hang(slug, rank):
    report = sample_report(slug)
    rc = report["root_cause"]
    assert (report["verdict"], rc["rule_id"], rc["category"], rc["rank"]) == (
        "hung", "hang.stopped_while_waiting", "hang", rank)


def test_a_stampless_stop_after_one_step_each_is_still_a_stop_from_outside(tmp_path):
    # the same log with every rank's steps after the first renamed: each rank printed one progress line only,
    # so nothing says start-up was over
    text = (SAMPLES / "quill_slow_np3_r2_acc.log").read_text()
    assert " step 1 " in text and " step 2 " in text
    log = tmp_path / "one_step_each.log"
    log.write_text(text.replace(" step 1 ", " phase one ").replace(" step 2 ", " phase two "))
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["category"]) == ("launcher.signal_exception", "external_stop")


@pytest.mark.parametrize("slug", ["quill_none_np3_rnone_hf", "quill_none_np4_rnone_hfacc"])
def test_a_rank_that_finished_its_run_after_the_trainers_records_is_ok(slug):
    report = sample_report(slug)
    assert (report["verdict"], report["root_cause"]) == ("ok", None)


@pytest.mark.parametrize("line, signed", [
    ("rank 0 finished quill stroke trainer run", True),
    ("finished training", True),
    ("rank 1 completed the job.", True),
    ("finished loading the run config", False),
    ("rank 0 finished step 3, waiting for the others", False),
])
def test_finished_its_run_is_a_sign_off(line, signed):
    assert bool(SIGNED_OFF.search(line)) is signed


@pytest.mark.parametrize("slug, rank, line", [
    ("sluice_selferror_np6_r3_plloglevel", 3, 78),
    ("tundra_error_exit_np5_r4_spawn", 4, 8),
])
def test_a_scripts_error_line_that_gives_up_is_the_logged_error(slug, rank, line):
    rc = sample_report(slug)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("python.logged_error", "python_exception",
                                                                      rank, line)
