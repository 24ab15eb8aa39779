"""With OMP_NUM_THREADS set, torchrun prints no start-up banner, so a `--redirects 3` or `--local-ranks-filter`
console can begin with the agent's teardown (`Sending process N closing signal SIGTERM`): no worker line ever came
before it, and the failed rank's exit code 1 is an uncaught exception whose traceback went to its own files
(cpu_adhoc 544th batch). So can a `--local-ranks-filter` console without --tee, whose first line is a shown rank's
own start-up line (552nd batch). A console with any line before the teardown, or one that begins after the shown
ranks' step 0, stays an exit code."""

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


FILTERED = SAMPLE.parent / "nrwhl_ring_key_np8_r5_filter.log"


def test_a_filter_console_that_begins_at_a_ranks_start_held_the_whole_run():
    # OMP_NUM_THREADS set, no banner, `--local-ranks-filter 0,1` without --tee: line 1 is rank 0's own start-up
    # line and its progress begins at step 0; rank 5's KeyError went nowhere the console shows
    assert FILTERED.read_text().startswith("rank 0/8 loaded rings_shard_00.pt")
    assert _root(FILTERED) == ("python.exit_one_output_elsewhere", "python_exception", 5)


def test_a_filter_console_cut_after_step_0_leaves_an_exit_code(tmp_path):
    lines = FILTERED.read_text().splitlines(keepends=True)
    assert lines[5].startswith("rank 0 step 1")
    log = tmp_path / "paste.log"
    log.write_text("".join(lines[5:]))   # a paste from rank 0's step 1 on
    assert _root(log) == ("signal.exit_nonzero", "unknown", 5)


TEED = SAMPLE.parent / "gannet_missing_shard_np6_r4_filter.log"


def test_a_filter_console_whose_shown_ranks_open_alike_held_the_whole_run():
    # `--tee 3 --local-ranks-filter 0,1`, 6 ranks, no banner and no step: ranks 1 and 0 each open with the line every
    # rank prints (`rank 1/6 gannet dive trainer up`), and rank 4, whose shard was missing, has none of it
    assert _root(TEED) == ("python.exit_one_output_elsewhere", "python_exception", 4)


def test_shown_ranks_opening_unalike_leave_an_exit_code(tmp_path):
    text = TEED.read_text()
    assert text.startswith("[default1]:rank 1/6 gannet dive trainer up")
    log = tmp_path / "paste.log"
    log.write_text(text.replace("[default1]:rank 1/6 gannet dive trainer up", "[default1]:rank 1 reading colony table", 1))
    assert _root(log) == ("signal.exit_nonzero", "unknown", 4)
