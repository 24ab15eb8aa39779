"""Lightning's own launcher (`python train.py --devices 4`) starts ranks 1.. as subprocesses of rank 0, whose observer
thread reports the first child it finds dead under that child's rank prefix and kills the rest: `[rank: 2] Child
process with PID 31156 terminated with code -11. Forcefully terminating all other processes to avoid zombies`
(lightning/fabric/strategies/launchers/subprocess_script.py). The code is the child's returncode: a negative one
names the signal, as torchrun's `failed (exitcode: -11)` does (a real CPU run, torch 2.13, Lightning 2.6.6,
sample_logs/cpu_adhoc, labelled before triage ran)."""

from __future__ import annotations

from logtriage.api import triage
from sample_roots import SAMPLES, root_facts

SLUG = "lgnd_segv_np4_r2_plown"
LINE = "Child process with PID 31156 terminated with code -11."


def test_the_observer_names_the_rank_that_died_of_a_signal():
    # rank 2 SIGSEGVed itself with no output of its own; ranks 1 and 3 then failed in their all_gather with gloo's
    # `Connection reset by peer`, and rank 0's observer printed the line at 299 and killed the group (exit 137)
    assert root_facts(SLUG)[:4] == ("signal.sigsegv", "crash_signal", 2, 299)


def _edited(tmp_path, code: str) -> dict:
    text = (SAMPLES / f"{SLUG}.log").read_text()
    assert LINE in text
    log = tmp_path / "edited.log"
    log.write_text(text.replace(LINE, LINE.replace("-11.", f"{code}.")))
    return triage([str(log)]).to_dict()["root_cause"]


def test_a_positive_code_is_an_exit_and_names_no_signal(tmp_path):
    rc = _edited(tmp_path, "3")
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("signal.exit_nonzero", "unknown", 2)


def test_a_sigkill_code_is_read_as_a_kill(tmp_path):
    rc = _edited(tmp_path, "-9")
    assert (rc["rule_id"], rc["rank"]) == ("signal.sigkill", 2)
