"""A `timeout` ends a hung Lightning job: Lightning's SIGTERM handler broadcasts the stop from inside whatever each
rank was doing, fails, and prints where that was. The ranks that waited were inside a collective; the one that held
them up was in its own code (cpu_adhoc batch 555, a real run on CPU with gloo). Where bash's notice says `timeout`
itself was killed, that time limit's reading stays (tests/test_timeout_killed_notice.py)."""

from __future__ import annotations

from sample_roots import SAMPLES, edited_report, verdict_and_root


def test_the_rank_a_sigterm_found_in_its_own_code_kept_the_others_waiting():
    # rank 1 spun in pure Python (`felt = (felt * 31 + i) % 1000003` in step_body); ranks 0 and 2 were in all_gather
    assert verdict_and_root("yurts_hang_np3_r1_pltorchrun") == ("hung", "hang.stopped_while_waiting", "hang", 1)


def test_two_ranks_at_work_name_no_rank(tmp_path):
    # had rank 0's handler, too, interrupted the program's own code, nothing would single out one rank
    text = (SAMPLES / "yurts_hang_np3_r1_pltorchrun.log").read_text()
    waiting_frame = ('[rank0]:   File "/tmp/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", '
                     'line 53, in _get_msg_dict')
    assert text.count(waiting_frame) == 1
    report = edited_report("yurts_hang_np3_r1_pltorchrun", waiting_frame,
                           '[rank0]:   File "/work/main/sample_logs/cpu_adhoc/fault555.py", line 112, in step_body',
                           tmp_path)
    rc = report["root_cause"]
    # the handlers' frames no longer single out one rank; the waits the stop ended still do (ranks 0 and 2 report
    # their 300 s waits as timed out a minute into the run, rank 1 only lost its peers: waits_the_stop_ended)
    assert not any("in its own code" in reason for reason in rc["reasons"])
    assert (report["verdict"], rc["rule_id"], rc["rank"]) == ("hung", "hang.stopped_while_waiting", 1)
