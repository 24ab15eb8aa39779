"""Stream assignment on real logs: ranks, launcher, banner, probes, blocks, late-bound pids."""

from __future__ import annotations

from logtriage.analysis.childfailed import parse_child_failures
from logtriage.api import run_triage
from logtriage.demux.blocks import BlockKind, continues
from logtriage.demux.streams import StreamKind
from tests.conftest import ROOT, SAMPLES

DATA = ROOT / "tests" / "data"


def _stream_of(run, line: int, source: int = 0):
    index = run.scan.indexes[source]
    return run.diagnosis.keys[run.scan.slots.final(index.slots[line - 1])]


def _line_of(path, needle: str) -> int:
    for number, text in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if needle in text:
            return number
    raise AssertionError(needle)


def test_traceback_block_child_failed_and_launcher_lines():
    log = SAMPLES / "cpu" / "rank_exception__np4.log"
    run = run_triage([str(log)])
    key_error = _line_of(log, "KeyError: 'target'")
    assert _stream_of(run, key_error).rank == 2
    assert _stream_of(run, key_error - 3).rank == 2            # a frame of the same traceback
    for needle in ("ChildFailedError", "Root Cause (first observed failure):", "Sending process"):
        assert _stream_of(run, _line_of(log, needle)).kind is StreamKind.LAUNCHER


def test_torchelastic_root_cause_is_weighed_not_believed():
    """The issue's example: the summary names the SIGABRT rank; the KeyError rank is the cause."""
    log = SAMPLES / "cpu" / "rank_exception__legacy_launch.log"
    report = run_triage([str(log)]).report.to_dict()
    assert report["root_cause"]["exception_type"] == "KeyError"
    assert report["root_cause"]["rank"] == 1
    assert any("names rank 0" in n and "points at rank 1" in n for n in report["notes"])


def test_banner_and_probes_become_their_own_streams():
    log = DATA / "ngc_banner_rank_exception.log"
    run = run_triage([str(log)])
    report = run.report.to_dict()
    assert _stream_of(run, _line_of(log, "== PyTorch ==")).kind is StreamKind.BANNER
    assert _stream_of(run, _line_of(log, "NVIDIA Release 22.10")).kind is StreamKind.BANNER
    assert _stream_of(run, _line_of(log, "insufficient for PyTorch")).kind is StreamKind.BANNER
    env = report["environment"]
    assert (env["container_image"], env["container_release"], env["nccl"]) == ("PyTorch", "22.10", "2.15.5")
    assert any("not valid JSON" in p for p in env["probe_problems"])   # a broken probe is reported
    assert report["root_cause"]["rank"] == 1 and report["root_cause"]["exception_type"] == "KeyError"


def test_tee_stdout_flushed_late_still_belongs_to_its_rank():
    log = SAMPLES / "cpu" / "rank_exception__tee3.log"
    run = run_triage([str(log)])
    for number, text in enumerate(log.read_text().splitlines(), 1):
        if text.startswith("[default1]:"):
            assert _stream_of(run, number).rank == 1


def test_mp_spawn_child_traceback_goes_to_its_process_rank():
    log = SAMPLES / "cpu" / "rank_exception__mp_spawn.log"
    run = run_triage([str(log)])
    report = run.report.to_dict()
    assert report["root_cause"]["rank"] == 1
    assert _stream_of(run, _line_of(log, "KeyError")).rank == 1


def test_every_line_lands_in_exactly_one_stream_for_a_folder(tmp_path):
    (tmp_path / "rank0.log").write_text("step 1 loss 0.5\nstep 2 loss 0.4\n")
    (tmp_path / "rank1.log").write_text("step 1 loss 0.6\nTraceback (most recent call last):\n"
                                        '  File "train.py", line 3, in <module>\nValueError: bad batch\n')
    report = run_triage([str(tmp_path)]).report.to_dict()
    assert report["input_lines"] == 6 == sum(s["lines"] for s in report["streams"])
    assert report["root_cause"]["rank"] == 1 and report["root_cause"]["line"] == 4
    assert report["root_cause"]["source"].endswith("rank1.log")


def test_exit_codes_own_failure_and_killed_agree_on_launcher_and_shell_forms():
    from logtriage.analysis.childfailed import is_killed, is_own_failure
    assert [is_own_failure(c) for c in (None, 0, 1, -6, -9, -15, 143, 137)] == \
        [False, False, True, True, True, False, False, True]
    assert [is_killed(c) for c in (None, 0, 1, -6, -9, -15, 143, 137)] == \
        [False, False, False, False, True, True, True, True]


def test_a_traceback_pasted_without_its_indentation_stays_one_block():
    # sample_logs/public6/msswift3343_*: the issue tracker lost the frames' indentation
    lines = ['File "/opt/conda/lib/python3.10/runpy.py", line 196, in _run_module_as_main',
             "return _run_code(code, main_globals, None,",
             'File "/opt/a.py", line 355, in wrapper', "return f(*args, **kwargs)", "^^^^^^^^^^^^^^^^^^",
             'File "<frozen runpy>", line 88, in _run_code',
             'File "/opt/b.py", line 3, in f', "main", "KeyError: 3"]
    state: dict = {}
    assert all(continues(BlockKind.TRACEBACK, line, state) for line in lines)
    assert state["exception"] == "KeyError: 3"
    assert not continues(BlockKind.TRACEBACK, "step 5 loss 0.1", state)
    # a frame whose source is not shown, straight before the exception line
    state = {}
    assert continues(BlockKind.TRACEBACK, 'File "<string>", line 1, in <module>', state)
    assert continues(BlockKind.TRACEBACK, "torch.OutOfMemoryError: CUDA out of memory.", state)
    assert state["exception"] == "torch.OutOfMemoryError: CUDA out of memory."


def test_open_mpi_notices_are_launcher_failures_with_their_rank():
    # real prterun 5 output (sample_logs/cpu_matrix/*mpirun_tag_output*): wrapped before "signal"
    wrapped = [(0, 40, "prterun noticed that process rank 0 with PID 6245 on node vm exited on"),
               (0, 41, "signal 9 (Killed).")]
    one_line = [(0, 7, "mpirun noticed that process rank 3 with PID 0 on node n1 exited on signal 11 (Segmentation fault).")]
    [first] = parse_child_failures(wrapped)
    assert (first.rank, first.pid, first.exitcode, first.signal, first.line, first.is_root_cause) == \
        (0, 6245, -9, "SIGKILL", 41, True)
    [only] = parse_child_failures(one_line)
    assert (only.rank, only.exitcode, only.signal, only.line) == (3, -11, "SIGSEGV", 7)
    # a head whose signal line never came is not a failure
    assert parse_child_failures(wrapped[:1] + [(0, 42, "something else")]) == []
    # both lines go to the launcher stream, as one block
    state: dict = {}
    assert continues(BlockKind.MPI_NOTICE, "signal 9 (Killed).", state)
    assert not continues(BlockKind.MPI_NOTICE, "signal 9 (Killed).", state)



def test_a_traceback_cut_above_its_first_frame_is_still_one_block(tmp_path):
    # sample_logs/public14/dle1092_*: the paste starts at a frame, without `Traceback (...)`
    log = tmp_path / "cut.log"
    log.write_text("step 40 loss 0.3\n"
                   'File "train.py", line 229, in save_checkpoint\n'
                   '    print("Updating symlink", symlink_dst)\n'
                   "FileExistsError: [Errno 17] File exists: 'a.pt' -> 'last.pt'\n"
                   "[rank1]:   File \"train.py\", line 12, in <module>\n"
                   "[rank1]: KeyError: 'x'\n")
    run = run_triage([str(log)])
    blocks = sorted(run.scan.blocks.values())
    assert blocks == [(0, 2, 4), (0, 5, 6)]
    assert sorted(run.scan.block_exceptions.values()) == [
        "FileExistsError: [Errno 17] File exists: 'a.pt' -> 'last.pt'", "KeyError: 'x'"]
    assert _stream_of(run, 6).rank == 1
    assert list(run.scan.block_checkpoint_frames.values()) == ["save_checkpoint"]


def test_a_prefixed_streams_abort_and_traceback_survive_other_ranks_lines_between(tmp_path):
    # sample_logs/cpu_matrix/collective_mismatch__dtype_nodebug_*_m300119: `--tee 3 --role trainer`;
    # rank 3's `terminate called` and its `what():` seven lines apart, other ranks' output between
    log = tmp_path / "interleaved.log"
    log.write_text(
        "[trainer3]:terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
        "[trainer2]:[rank 2] step 2 loss 0.4571\n"
        "W1130 17:32:23.902000 28752 torch/distributed/elastic/multiprocessing/api.py:1028] "
        "Sending process 28805 closing signal SIGTERM\n"
        "[trainer4]:[rank4]: Traceback (most recent call last):\n"
        "[trainer3]:  what():  [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
        "pair.cc:456] op.preamble.length <= op.nbytes. 8 vs 4. Received data size doesn't match expected size.\n"
        "[trainer4]:[rank4]:   File \"/w/collective_mismatch.py\", line 44, in main\n"
        "[trainer5]:[rank 5] step 2 loss 0.2109\n"
        "[trainer4]:[rank4]:     dist.all_reduce(odd_metric(metric, args.kind))\n"
        "[trainer4]:[rank4]:   File \"/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py\", "
        "line 3252, in all_reduce\n"
        "[trainer2]:[rank 2] step 3 loss 0.3120\n"
        "[trainer4]:[rank4]:     work.wait()\n"
        "[trainer4]:[rank4]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
        "Read error [127.0.0.1]:37769: Connection reset by peer.\n"
        "[trainer3]:[rank 3] step 2 loss 0.4113\n")
    run = run_triage([str(log)])
    by_line = {f.line: f for f in run.diagnosis.findings}
    assert 1 not in by_line                        # `terminate called` yields to its what() line
    assert by_line[5].rule.id == "gloo.size_mismatch" and by_line[5].rank == 3
    reset = by_line[12]                            # rank 4's traceback kept its all_reduce frame
    assert reset.rank == 4 and run.scan.block_collectives[reset.block_id] == "all_reduce"
    rc = run.report.to_dict()["root_cause"]
    assert (rc["rule_id"], rc["line"]) == ("gloo.size_mismatch", 5)


def test_a_scripts_own_progress_print_that_starts_with_its_rank_is_that_ranks(tmp_path):
    # sample_logs/cpu_adhoc/no_sync_rank_np5_r4_spawn: `print(f"rank {rank} step {step} loss ...")`
    log = tmp_path / "prints.log"
    log.write_text("rank 4 step 1 loss 1.4557\n"
                   "Rank 3 epoch 2 done\n"
                   "rank 2 iteration 7\n"
                   "rank 1: loading data\n"
                   "rank 0 is the master\n"          # `is`: a report another rank could make, not a marker
                   "rank 5 steps ahead\n")           # any other word: the line is rank 5's own
    run = run_triage([str(log)])
    assert [_stream_of(run, n).rank_or_none for n in range(1, 7)] == [4, 3, 2, 1, None, 5]
    assert run.diagnosis.streams and {s.key.rank: s.last_step for s in run.diagnosis.streams
                                      if s.key.rank is not None}[4] == 1



def test_a_tqdm_style_it_counter_an_it_key_and_a_json_step_key_are_progress_lines_on_both_engines(tmp_path):
    # sample_logs/cpu_adhoc/herring_*: `print(f"[{rank}] it {step}/{steps} | loss {loss:.4f}")`
    from logtriage.api import TriageOptions
    log = tmp_path / "it.log"
    log.write_text("[rank0]: [0] it 1/7 | loss 1.2000\n"
                   "[rank1]: [1] it 1/7 | loss 1.1000\n"
                   "[rank0]: [0] it 2/7 | loss 0.9000\n"
                   "[rank1]: commit 3/4 of the shard index\n"      # `it` inside a word: no counter
                   "[rank1]: wait 5/6 seconds\n"
                   "[rank0]: exit 9/9\n"
                   '[rank1]: {"step": 3, "loss": 0.81}\n'            # a JSON record's key (dl_handled_np6_r0_plain)
                   "[rank0]: rank0/2 it=4 loss=0.8586\n"             # a key=value counter (stall_fh_np6_r4_tee)
                   "[rank1]: split=9 limit=12 exit=1\n")             # `it=` ending a longer word: no counter
    for engine in ("exact", "fast"):
        run = run_triage([str(log)], TriageOptions(engine=engine))
        assert {s.key.rank: s.last_step for s in run.diagnosis.streams if s.key.rank is not None} == {0: 4, 1: 3}

_GROUP_SCRIPT = """
def inner():
    raise ExceptionGroup("shards", [KeyError("input_ids")])
try:
    inner()
except* KeyError as group:
    raise ExceptionGroup("loader failed", [ValueError("shard 3 is empty"), group.exceptions[0]])
"""


def test_an_exception_groups_margin_is_read_as_tracebacks(tmp_path):
    # CPython's own rendering (`  + Exception Group Traceback`, `  | `, `  +-+---- 1 ----`), as a
    # rank prints it, a group re-raised while handling another: the root is the first group's
    # sub-exception, the original error of the chain, on its own line (gaps31 rows 13-17, 70-71)
    import subprocess
    import sys

    from logtriage.demux.clean import ungrouped
    printed = subprocess.run([sys.executable, "-c", _GROUP_SCRIPT], capture_output=True, text=True,
                             check=False).stderr
    assert "+ Exception Group Traceback" in printed
    log = tmp_path / "g.log"
    log.write_text("".join(f"[rank1]:{line}\n" for line in printed.splitlines()))
    report = run_triage([str(log)]).report.to_dict()
    rc = report["root_cause"]
    assert (rc["category"], rc["rank"], rc["exception_type"]) == ("python_exception", 1, "KeyError")
    assert rc["line"] == _line_of(log, "KeyError: 'input_ids'")
    # a table drawn with `|` (Lightning's model summary) is not an exception group
    for row in ("  | Name  | Type   | Params | Mode", "  | Total params: 1.2 M"):
        assert ungrouped(row) == row
