"""`timeout --kill-after=5 60 torchrun ...` where torchrun did not stop within 5 s of timeout's TERM: timeout then
kills its own process group, itself with it, and bash reports the job as `./run1.sh: line 17: 17536 Killed
timeout --kill-after=5 60 setsid torchrun ...`. No exit status 124 and no SignalException traceback reach the log
(a real CPU run, torch 2.13, Lightning 2.6.6 under torchrun, one rank waiting for a lock file before step 3,
sample_logs/cpu_adhoc batch 442, labelled before triage ran). The notice is the time limit's, so the run hung."""

from __future__ import annotations

import pytest

from logtriage.api import triage
from logtriage.catalog.loader import load_catalog
from logtriage.catalog.matcher import match_line
from sample_roots import SAMPLES, root_facts, verdict_and_root

SLUG = "tremor_hang_np4_r1_pltorchrun"
NOTICE = "17536 Killed                  timeout --kill-after=5 60 setsid torchrun"


def test_the_killed_timeout_is_the_time_limit_that_ended_a_hang():
    assert verdict_and_root(SLUG) == ("hung", "hang.command_timeout", "hang", 1)
    assert root_facts(SLUG)[3] == 39


def _without_timeout_in_the_notice(tmp_path) -> dict:
    text = (SAMPLES / f"{SLUG}.log").read_text()
    assert NOTICE in text
    log = tmp_path / "edited.log"
    log.write_text(text.replace(NOTICE, NOTICE.replace("timeout --kill-after=5 60 ", "")))
    return triage([str(log)]).to_dict()


def test_another_command_killed_is_no_time_limit(tmp_path):
    # the same notice for torchrun itself says only that something SIGKILLed it: no sign of a time limit
    report = _without_timeout_in_the_notice(tmp_path)
    assert report["root_cause"]["rule_id"] != "hang.command_timeout"
    assert all(f["rule_id"] != "hang.command_timeout" for f in report["findings"])


@pytest.mark.parametrize("command, limit", [
    ("timeout --kill-after=5 60 setsid torchrun --nproc-per-node 4 train.py", True),
    ("timeout -k 5 60 torchrun --nproc-per-node 4 train.py", True),
    ("timeout -s KILL 2h python train.py", True),
    ("timeout 600 python train.py", True),
    ("python train.py --timeout 60", False),
])
def test_the_notice_is_the_limit_only_for_timeout_itself(command, limit):
    rules = [hit.rule.id for hit in match_line(load_catalog(), f"./job.sh: line 9: 4242 Killed                  {command}")]
    assert ("hang.command_timeout" in rules) is limit
