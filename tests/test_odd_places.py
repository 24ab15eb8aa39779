"""Errors raised off the main thread and in odd places (a thread, a handler, a finalizer at exit, a
fork refused), and the launcher forms they came with, on small excerpts of real CPU runs of torch
2.13 (sample_logs/cpu_adhoc, the 44th-46th batches: each case names its run)."""

from __future__ import annotations

from logtriage.api import triage
from logtriage.demux.line_marks import find_rank_marker
from logtriage.demux.prefixes import Dialect, strip_prefixes

PY = "/root/.pyenv/versions/3.11.7/lib/python3.11"
TORCH = "/tmp/venv/lib/python3.11/site-packages/torch"
THREAD_FRAMES = (f'  File "{PY}/threading.py", line 1045, in _bootstrap_inner\n    self.run()\n'
                 f'  File "{PY}/threading.py", line 982, in run\n    self._target(*self._args, **self._kwargs)\n'
                 '  File "/tmp/job/fault46.py", line 198, in prefetch\n    x = torch.tensor([parse_row(row)] * BATCH)\n')
LOST_PEER = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
             "closed by peer [127.0.0.1]:47297. This is typically caused by a remote worker crashing.")


def _report(tmp_path, text: str) -> dict:
    log = tmp_path / "run.log"
    log.write_text(text)
    return triage([str(log)]).to_dict()


def _prefixed(label: str, block: str) -> str:
    return "".join(f"{label}{line}\n" for line in block.splitlines())


def test_a_threads_error_is_the_root_of_the_stall_its_rank_dies_of_later(tmp_path):
    # thr_prefetchwait_np2_r0_tee: rank 0's prefetcher thread dies; the main loop runs on the queued
    # batches, then its queue.get times out (`_queue.Empty` -> RuntimeError): that is the consequence
    thread = "Exception in thread prefetcher:\nTraceback (most recent call last):\n" + THREAD_FRAMES + \
             "ValueError: could not convert string to float: 'n/a'\n"
    stalled = ('Traceback (most recent call last):\n  File "/tmp/job/fault46.py", line 220, in main\n'
               '    x, y = q.get(timeout=5)\n  File "' + PY + '/queue.py", line 179, in get\n    raise Empty\n'
               "_queue.Empty\n\nThe above exception was the direct cause of the following exception:\n\n"
               'Traceback (most recent call last):\n  File "/tmp/job/fault46.py", line 222, in main\n'
               '    raise RuntimeError(f"prefetcher stalled: no batch for step {step} after 5 s") from e\n'
               "RuntimeError: prefetcher stalled: no batch for step 3 after 5 s\n")
    text = (_prefixed("[default0]:", thread)
            + "[default1]:rank 1 step 1 loss 1.3725\n[default0]:rank 0 step 1 loss 1.3725\n"
            + "[default0]:rank 0 step 2 loss 1.3355\n[default1]:rank 1 step 2 loss 1.3355\n"
            + _prefixed("[default0]:[rank0]: ", stalled)
            + _prefixed("[default1]:[rank1]: ", "Traceback (most recent call last):\n" + LOST_PEER))
    rc = _report(tmp_path, text)["root_cause"]
    assert (rc["exception_type"], rc["rank"], rc["line"]) == ("ValueError", 0, 9)


def test_an_unprefixed_threads_error_belongs_to_the_one_rank_that_raised_nothing(tmp_path):
    # thr_prefetch_np4_r3_plain: the bare thread traceback carries no rank; ranks 0-2 time out or lose
    # their peer in the next all-reduce; rank 3 (stuck on its dead prefetcher's queue) says nothing
    thread = "Exception in thread prefetcher:\nTraceback (most recent call last):\n" + THREAD_FRAMES + \
             "ValueError: could not convert string to float: 'n/a'\n"
    timeout = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
               "Timed out waiting 15000ms for recv operation to complete")
    text = ("rank 2 world 4, 6 steps\nrank 1 world 4, 6 steps\nrank 3 world 4, 6 steps\n" + thread
            + "rank 0 world 4, 6 steps\n"
            + _prefixed("[rank1]: ", "Traceback (most recent call last):\n" + LOST_PEER)
            + _prefixed("[rank2]: ", "Traceback (most recent call last):\n" + timeout)
            + _prefixed("[rank0]: ", "Traceback (most recent call last):\n" + timeout.replace("recv", "send"))
            + "W1203 04:50:37.450000 25304 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process "
              "25382 closing signal SIGTERM\n"
            + "E1203 04:50:37.522000 25304 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
              "(exitcode: 1) local_rank: 1 (pid: 25383) of binary: /tmp/venv/bin/python3\n")
    rc = _report(tmp_path, text)["root_cause"]
    assert (rc["exception_type"], rc["rank"]) == ("ValueError", 3)


def _chain(first: str, second_frames: str, second: str) -> str:
    return ('Traceback (most recent call last):\n' + first
            + "\nDuring handling of the above exception, another exception occurred:\n\n"
            + 'Traceback (most recent call last):\n  File "/tmp/job/train.py", line 305, in <module>\n    main()\n'
            + second_frames + second + "\n")


def test_a_handler_whose_own_call_fails_is_read_by_the_first_exception(tmp_path):
    # thr_handling_np4_r2_plain: the KeyError's handler writes an emergency checkpoint into a missing
    # folder; the failed save is the handler's, the KeyError the rank's failure
    first = '  File "/tmp/job/train.py", line 240, in main\n    y = rec["y"]\nKeyError: \'y\'\n'
    frames = ('  File "/tmp/job/train.py", line 246, in main\n    torch.save(model.state_dict(), path)\n'
              f'  File "{TORCH}/serialization.py", line 1002, in save\n    with _open_zipfile_writer(f) as z:\n'
              f'  File "{TORCH}/serialization.py", line 828, in __init__\n    torch._C.PyTorchFileWriter(\n')
    text = _prefixed("[rank2]: ", _chain(first, frames, "RuntimeError: Parent directory /tmp/job/out_missing "
                                                        "does not exist."))
    rc = _report(tmp_path, text)["root_cause"]
    assert (rc["rule_id"], rc["exception_type"], rc["rank"]) == ("python.exception", "KeyError", 2)


def test_a_with_blocks_cleanup_failing_in_turn_is_the_same_operation(tmp_path):
    # fsize_save_np6_r5: torch.save's writer fails, and its `with` block's __exit__ fails on the short
    # file: the second, plainer message (a short write) says what happened
    first = (f'  File "{TORCH}/serialization.py", line 1003, in save\n    _save(\n'
             f'  File "{TORCH}/serialization.py", line 1312, in _save\n    zip_file.write_record(name, s, n)\n'
             "RuntimeError: basic_ios::clear: iostream error\n")
    frames = ('  File "/tmp/job/train.py", line 114, in main\n    torch.save(state, path)\n'
              f'  File "{TORCH}/serialization.py", line 1002, in save\n    with _open_zipfile_writer(f) as z:\n'
              f'  File "{TORCH}/serialization.py", line 834, in __exit__\n    self.file_like.write_end_of_file()\n')
    text = _prefixed("[rank5]: ", _chain(first, frames, "RuntimeError: [enforce fail at inline_container.cc:672] "
                                                        ". unexpected pos 1984 vs 1876"))
    rc = _report(tmp_path, text)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("ckpt.write_failed", "checkpoint", 5)


def test_a_finalizers_error_at_exit_after_every_rank_finished_is_no_failure(tmp_path):
    # thr_finalizectl_np5_r4_prefix: weakref.finalize's callback fails as the interpreter exits (exit 0)
    finalizer = ('Traceback (most recent call last):\n'
                 f'  File "{PY}/weakref.py", line 666, in _exitfunc\n    f()\n'
                 f'  File "{PY}/weakref.py", line 590, in __call__\n'
                 '    return info.func(*info.args, **(info.kwargs or {}))\n'
                 "FileNotFoundError: [Errno 2] No such file or directory: '/tmp/job/tmp_rank4.bin'\n")
    text = ("".join(f"[default|rank={r}|local={r}] rank {r} step 6 loss 1.37\n"
                    f"[default|rank={r}|local={r}] rank {r} training finished\n" for r in range(2))
            + _prefixed("[default|rank=1|local=1] [rank1]: ", finalizer))
    report = _report(tmp_path, text)
    assert report["verdict"] == "ok" and report["root_cause"] is None


def test_eagain_where_python_forks_is_a_process_limit(tmp_path):
    # res_nprocloader_np3_r2_tee: a DataLoader worker's fork under RLIMIT_NPROC
    frames = (f'  File "{TORCH}/utils/data/dataloader.py", line 1176, in __init__\n    w.start()\n'
              f'  File "{PY}/multiprocessing/popen_fork.py", line 66, in _launch\n    self.pid = os.fork()\n')
    text = _prefixed("[default2]:[rank2]: ", "Traceback (most recent call last):\n" + frames
                     + "BlockingIOError: [Errno 11] Resource temporarily unavailable")
    rc = _report(tmp_path, text)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("host.thread_limit", "environment", 2)


def test_a_prefix_template_without_a_space_is_stripped():
    # dbg_nockpt_np4_r0_prefix: TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[${role_name}|r${rank}]'
    p = strip_prefixes("[default|r0][rank0]: FileNotFoundError: [Errno 2] No such file or directory", Dialect())
    assert (p.rank, p.text) == (0, "FileNotFoundError: [Errno 2] No such file or directory")
    assert strip_prefixes("[default|r1]/tmp/job/fault45.py:104: UserWarning: x", Dialect()).rank == 1


def test_a_scripts_own_line_that_starts_with_its_rank_names_it():
    # thr_warnctl_np2_r1_plain, thr_ckptflag_np5_r3_prefix
    assert find_rank_marker("rank 1 training finished") == 1
    assert find_rank_marker("rank 1 WARNING metrics uploader: step 4 not uploaded, continuing") == 1
    assert find_rank_marker("rank 3 ERROR step 4: checkpoint writer failed, stopping") == 3
    # any word after it, not only progress words (`rank 2 task 0 step 3`, `rank 1 of 4 ready`: hnet and capsn
    # batches under a hand-made loop), but not one that links it to more
    assert find_rank_marker("rank 2 task 0 step 3 loss 0.2275 wnorm 2.306") == 2
    assert find_rank_marker("rank 2 re-evaluating all earlier tasks before reducing task 0 loss") == 2
    assert find_rank_marker("rank 1 of 4 ready (DistributedType.MULTI_CPU)") == 1
    assert find_rank_marker("rank 0 and rank 1 disagree on the vocabulary") is None
    assert find_rank_marker("rank 2 to rank 3: 4 tensors") is None
    assert find_rank_marker("rank 2 42 tensors") is None


def test_a_chinese_codebases_labels_are_read():
    # zh_nan_np4_r1_template (`[${role_name}|第${local_rank}卡] `: a field the tool cannot read, before
    # torch's `[rank1]: `) and zh_nockpt_np4_r3_role (`--role 训练器`)
    p = strip_prefixes("[default|第1卡] [rank1]: FloatingPointError: 损失为 NaN，停止训练", Dialect())
    assert (p.rank, p.text) == (1, "FloatingPointError: 损失为 NaN，停止训练")
    p = strip_prefixes("[训练器3]:[rank3]: FileNotFoundError: [Errno 2] No such file or directory", Dialect())
    assert (p.rank, p.local_rank, p.text[:17]) == (3, 3, "FileNotFoundError")


def test_a_chinese_codebases_run_that_finished_is_ok(tmp_path):
    # zh_ok_np4_rnone_plain: each rank's last line says 训练结束 (training ended); exit 0, no summary
    text = "".join(f"[rank {r}] 第 8 步 损失 1.2345 学习率 0.001\n" for r in range(2)) + \
        "".join(f"[rank {r}] 训练结束\n" for r in range(2))
    assert _report(tmp_path, text)["verdict"] == "ok"
