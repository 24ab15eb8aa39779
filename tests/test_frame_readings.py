"""Exceptions read by the frame that raised them, on small logs in torchrun's console format
(each case names the report its text comes from)."""

from __future__ import annotations

import pytest

from logtriage.api import triage

FRAMES = ('[rank1]: Traceback (most recent call last):\n'
          '[rank1]:   File "/workspace/train.py", line 42, in <module>\n'
          '[rank1]:     main()\n'
          '[rank1]:   File "{path}", line {line}, in {function}\n'
          '[rank1]:     {code}\n'
          '[rank1]: {error}\n'
          'E1201 10:00:00.000000 1234 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1) '
          'local_rank: 1 (pid: 1235) of binary: /usr/bin/python\n')
INDUCTOR = "/usr/lib/python3.10/site-packages/torch/_inductor/"


@pytest.mark.parametrize("path, function, code, error", [
    # pytorch/pytorch#172144: FxGraphCache reading an entry another process was still writing
    (INDUCTOR + "codecache.py", "iterate_over_candidates", "graph = pickle.loads(content)",
     "_pickle.UnpicklingError: pickle data was truncated"),
    (INDUCTOR + "codecache.py", "load", "graph = pickle.load(f)", "EOFError: Ran out of input"),
    # pytorch/pytorch#153791: the ranks of a node writing the autotune cache's best config at once
    (INDUCTOR + "runtime/autotune_cache.py", "_read", "return json.loads(fd.read())",
     "json.decoder.JSONDecodeError: Extra data: line 1 column 1523 (char 1522)"),
])
def test_a_half_written_entry_of_torch_compiles_cache_is_a_cache_race(tmp_path, path, function, code, error):
    log = tmp_path / "race.log"
    log.write_text("[rank0]: step 10 loss 2.31\n" + FRAMES.format(path=path, line=1120, function=function, code=code,
                                                                    error=error))
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("data.cache_race", "environment", 1, 7)


def test_the_same_errors_outside_the_compile_cache_keep_their_own_reading(tmp_path):
    log = tmp_path / "ckpt.log"
    log.write_text(FRAMES.format(path="/workspace/train.py", line=88, function="load_state", code="state = torch.load(p)",
                                 error="EOFError: Ran out of input"))
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("ckpt.corrupt_archive", "checkpoint", 1, 6)


CALL = ('[rank1]: Traceback (most recent call last):\n'
        '[rank1]:   File "/workspace/train.py", line 42, in <module>\n'
        '[rank1]:     main()\n'
        '[rank1]:   File "/workspace/train.py", line 88, in load_target\n'
        '[rank1]:     target = torch.load(f"{{WORK}}/{{REGISTRY[pattern]}}")\n'
        '[rank1]:     {carets}\n'
        "[rank1]: KeyError: 'gecko'\n"
        'E1201 10:00:00.000000 1234 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1) '
        'local_rank: 1 (pid: 1235) of binary: /usr/bin/python\n')


@pytest.mark.parametrize("carets, rule", [
    # Python 3.11's markers under `REGISTRY[pattern]`, inside the call's parentheses: the path's own lookup failed
    # before torch.load ran (sample_logs/cpu_adhoc/nca_pattern_*, the 254th batch)
    (" " * 37 + "~~~~~~~~^^^^^^^^^", "python.exception"),
    # the markers under the whole call, its frames cut from the paste: the load itself raised, on the file's keys
    ("         ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^", "ckpt.format_mismatch"),
])
def test_markers_inside_a_load_calls_arguments_say_the_checkpoint_was_never_read(tmp_path, carets, rule):
    log = tmp_path / "load.log"
    log.write_text(CALL.format(carets=carets))
    assert triage([str(log)]).to_dict()["root_cause"]["rule_id"] == rule
