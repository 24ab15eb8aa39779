"""With OMP_NUM_THREADS set, torchrun prints no start-up banner, so a `--redirects 3` or `--local-ranks-filter`
console can begin with the agent's teardown (`Sending process N closing signal SIGTERM`): no worker line ever came
before it, and the failed rank's exit code 1 is an uncaught exception whose traceback went to its own files
(cpu_adhoc 544th batch). A console with any line before the teardown stays an exit code."""

from __future__ import annotations

from pathlib import Path

from logtriage.api import triage

SAMPLE = Path(__file__).resolve().parent.parent / "sample_logs" / "cpu_adhoc" / "wharf_keyerror_np6_r5_redirects.log"


def _root(path: Path) -> tuple:
    rc = triage([str(path)]).to_dict()["root_cause"]
    return rc["rule_id"], rc["category"], rc["rank"]


def test_a_console_that_begins_with_the_teardown_held_the_whole_run():
    assert SAMPLE.read_text().startswith("W1207 04:05:57.344000 26454 torch/distributed/elastic/multiprocessing/api.py"
                                         ":1028] Sending process 26543 closing signal SIGTERM")
    assert _root(SAMPLE) == ("python.exit_one_output_elsewhere", "python_exception", 5)


def test_a_paste_from_the_failure_line_on_leaves_an_exit_code(tmp_path):
    # the summary alone, pasted from the agent's failure line: nothing says the worker's output went elsewhere
    log = tmp_path / "paste.log"
    log.write_text("".join(line for line in SAMPLE.read_text().splitlines(keepends=True)
                           if "closing signal SIGTERM" not in line))
    assert _root(log) == ("signal.exit_nonzero", "unknown", 5)


def test_a_line_before_the_teardown_leaves_an_exit_code(tmp_path):
    log = tmp_path / "paste.log"
    log.write_text("see the log below\n" + SAMPLE.read_text())
    assert _root(log) == ("signal.exit_nonzero", "unknown", 5)
