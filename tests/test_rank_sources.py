"""Where a rank comes from when the failing line carries no torchrun prefix: a launcher's notice
after an unprefixed traceback, a framework's process name, a message's own opening words, and
NCCL's transport error on the one rank that did not time out (gaps round 38, each case naming the
format it copies)."""

from __future__ import annotations

import pytest

from logtriage.api import TriageOptions, triage

OOM = ("Traceback (most recent call last):\n"
       '  File "/workspace/train.py", line 30, in main\n'
       "    loss.backward()\n"
       "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
       "of 79.15 GiB of which 1.02 GiB is free.\n")
WATCHDOG = ("[E1201 10:10:00.100000000 ProcessGroupNCCL.cpp:685] [Rank {r}] Watchdog caught collective operation "
            "timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, "
            "Timeout(ms)=600000) ran for 600045 milliseconds before timing out.\n")


def _root(tmp_path, text: str, fast: bool = False) -> dict:
    log = tmp_path / "run.log"
    log.write_text(text)
    options = TriageOptions(engine="fast" if fast else "exact")
    return triage([str(log)], options).to_dict()["root_cause"]


def test_an_mpi_abort_notice_names_the_rank_of_the_traceback_before_it(tmp_path):
    # Open MPI's help-mpi-api.txt banner (as in UCL/hemelb#4), printed after the exception hook's
    # traceback; the other ranks carry `--tag-output` labels
    banner = ("-" * 74 + "\nMPI_ABORT was invoked on rank 2 in communicator MPI_COMM_WORLD\nwith errorcode 1.\n\n"
              "NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.\n" + "-" * 74 + "\n")
    rc = _root(tmp_path, OOM + banner + "".join(f"[1,{r}]<stderr>:" + WATCHDOG.format(r=r) for r in (0, 1)))
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("cuda.oom", "gpu_oom", 2, 4)
    # another rank's line between the traceback and the banner: the banner may be that rank's
    rc = _root(tmp_path, OOM + "[1,3]<stderr>:RuntimeError: NCCL communicator was aborted on rank 3.\n" + banner)
    # (the OOM's "GPU 0" then gives local rank 0, as for any unattributed OOM on one node)
    assert (rc["rule_id"], rc["rank"], rc["ranks"]) == ("cuda.oom", 0, [0])


@pytest.mark.parametrize("prefix, rank", [
    ("(VllmWorker TP2 pid=438) ERROR 08-28 07:32:18 [multiproc_executor.py:559] ", 2),   # LMCache/LMCache#1455
    ("(Worker_TP2 pid=438) ERROR 08-28 07:32:18 [multiproc_executor.py:559] ", 2),        # vLLM v1 process name
    ("(Worker_PP1_TP0 pid=438) ERROR 08-28 07:32:18 [multiproc_executor.py:559] ", None),  # no world rank
])
def test_vllm_worker_names_give_the_tensor_parallel_rank(tmp_path, prefix, rank):
    # (the message names no GPU: a GPU number alone would give a rank of its own)
    rc = _root(tmp_path, "".join(prefix + line + "\n" for line in OOM.split(" GPU 0")[0].splitlines()))
    assert (rc["rule_id"], rc["rank"]) == ("cuda.oom", rank)


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("opening", ["(rank 2) ", "> rank 2 ", "(Rank 2)"])
def test_a_message_that_opens_with_its_rank_is_that_ranks(tmp_path, opening, fast):
    # a user's f-string `(rank {rank}) ...` and a Megatron-style `> rank N` print; the fast scan
    # reads the same rank as the exact path
    rc = _root(tmp_path, opening + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
               "GPU 0 has a total capacity of 79.15 GiB of which 1.02 GiB is free.\n", fast)
    assert (rc["rule_id"], rc["rank"]) == ("cuda.oom", 2)


def test_numbers_after_a_paren_or_arrow_that_are_not_ranks_stay_unread(tmp_path):
    rc = _root(tmp_path, "> ranked 2 torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n")
    assert (rc["rule_id"], rc["rank"]) == ("cuda.oom", None)
    rc = _root(tmp_path, "(rank 2 of 4 torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n")
    assert rc["rank"] is None


def test_the_one_rank_whose_nccl_link_broke_before_the_others_timed_out_is_the_root(tmp_path):
    # NCCL's net_ib.cc completion error (format of NVIDIA/nccl#928) on rank 2's process, whose
    # rank its `comm ... rank 2 nranks 4` INFO line gives; ranks 0, 1, 3 then time out
    text = ("node02:2201:2201 [0] NCCL INFO comm 0x55d5c8a0 rank 2 nranks 4 cudaDev 0 nvmlDev 0 busId 1b000 "
            "commId 0x9f1a - Init COMPLETE\n"
            "node02:2201:2250 [0] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion from peer "
            "10.0.0.4<41234> with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid ::ffff:10.0.0.3 "
            "remoteGids ::ffff:10.0.0.4\n"
            + "".join(f"[rank{r}]:" + WATCHDOG.format(r=r) for r in (0, 1, 3)))
    rc = _root(tmp_path, text)
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("nccl.remote_error", "collective_error", 2, 2)
    # the same error printed after a timeout is the aftermath of that timeout
    lines = text.splitlines(keepends=True)
    rc = _root(tmp_path, lines[0] + lines[2] + lines[1] + "".join(lines[3:]))
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["ranks"]) == (
        "nccl.watchdog_timeout", "collective_timeout", None, [0, 1, 3])


def test_accelerates_shape_list_names_the_rank_whose_shape_differs(tmp_path):
    # accelerate 1.15's verify_operation under `accelerate launch --debug` (as in
    # sample_logs/cpu_adhoc/acc_gather_shape_np5_r4_debug): every rank raises and lists each shape
    error = ("[rank{r}]: accelerate.utils.operations.DistributedOperationException: Cannot apply desired operation "
             "due to shape mismatches. All shapes across devices must be valid.\n[rank{r}]: \n"
             "[rank{r}]: Operation: `accelerate.utils.operations.gather`\n[rank{r}]: Input shapes:\n"
             + "".join(f"[rank{{r}}]:   - Process {p}: {'[16, 1]' if p == 3 else '[16]'}\n" for p in range(4)))
    rc = _root(tmp_path, "".join(error.format(r=r) for r in range(4)))
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("dist.collective_mismatch", "collective_mismatch", 3)
    # two shapes against two: no odd one out
    even = error.replace("Process 2: [16]", "Process 2: [16, 1]")
    rc = _root(tmp_path, "".join(even.format(r=r) for r in range(4)))
    assert (rc["rule_id"], rc["rank"], rc["ranks"]) == ("dist.collective_mismatch", 0, [0, 1, 2, 3])


GLOO_TIMEOUT = ("[rank{r}]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:"
                "129] Timed out waiting 15000ms for send operation to complete\n")
GLOO_CLOSED = ("[rank{r}]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
               "Connection closed by peer [127.0.0.1]:26020. This is typically caused by a remote worker crashing.\n")


def _in(rank: int, function: str, error: str) -> str:
    """One rank's traceback ending in `function` (a frame of torch's own code), then `error`."""
    path = ("/tmp/venv/torch/distributed/distributed_c10d.py" if function != "_engine_run_backward"
            else "/tmp/venv/torch/autograd/graph.py")
    return (f"[rank{rank}]: Traceback (most recent call last):\n"
            f'[rank{rank}]:   File "/tmp/job/train.py", line 84, in loop\n[rank{rank}]:     step()\n'
            f'[rank{rank}]:   File "{path}", line 979, in {function}\n[rank{rank}]:     work.wait()\n'
            + error.format(r=rank))


def test_the_one_rank_that_did_not_time_out_but_lost_the_others_was_elsewhere(tmp_path):
    # sample_logs/cpu_adhoc/acc_main_only_barrier_np4: rank 0 alone in a barrier (a
    # wait_for_everyone under `if is_main_process`); ranks 1-3 time out in DDP's backward all-reduce
    text = _in(0, "barrier", GLOO_CLOSED) + "".join(_in(r, "_engine_run_backward", GLOO_TIMEOUT) for r in (1, 2, 3))
    rc = _root(tmp_path, text)
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("gloo.timeout", "collective_timeout", 0)
    # in one of the collectives the waiting ranks were spread over, it lost them as their peer
    # (sample_logs/cpu_adhoc/tag_mismatch_np5_r2_role): that says nothing of who was late
    text = (_in(0, "_engine_run_backward", GLOO_CLOSED) + _in(1, "send", GLOO_TIMEOUT) + _in(2, "recv", GLOO_TIMEOUT)
            + "".join(_in(r, "_engine_run_backward", GLOO_TIMEOUT) for r in (3, 4)))
    rc = _root(tmp_path, text)
    assert (rc["rule_id"], rc["rank"], rc["ranks"]) == ("gloo.timeout", None, [1, 2, 3, 4])
    # three waiters timed out in the one collective it was in too: it came to it after all of them
    # (sample_logs/cpu_adhoc/late_drift_np4_r3_plain)
    text = _in(0, "all_reduce", GLOO_CLOSED) + "".join(_in(r, "all_reduce", GLOO_TIMEOUT) for r in (1, 2, 3))
    rc = _root(tmp_path, text)
    assert (rc["rule_id"], rc["rank"], rc["ranks"]) == ("gloo.timeout", 0, [0])


def test_mpichs_banner_gives_the_signal_below_it_the_rank_above_it(tmp_path):
    # MPICH 4 / Intel MPI hydra's bad-termination banner (as in bsc-performance-tools/extrae#101)
    # after the survivors' gloo errors, which carry no rank of their own here
    closed = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by peer "
              "[10.0.0.3]:41562\n")
    banner = ("=" * 83 + "\n=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n"
              "=   RANK 2 PID 1236 RUNNING AT node01\n=   KILLED BY SIGNAL: 9 (Killed)\n" + "=" * 83 + "\n")
    rc = _root(tmp_path, closed * 3 + "\n" + banner)
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("signal.sigkill", "crash_signal", 2, 8)


def test_a_launcher_line_right_after_an_exception_is_not_its_message(tmp_path):
    # gaps round 40 row 43: rank 2's KeyError, then the agent of a node srun stopped; the launcher's
    # `Received 15 death signal` is its own line, not the KeyError's message
    text = ("[rank2]: Traceback (most recent call last):\n"
            '[rank2]:   File "/workspace/train.py", line 30, in main\n[rank2]:     batch = next(it)\n'
            "[rank2]: KeyError: 'input_ids'\n"
            "W1201 10:00:06.000000 1200 torch/distributed/elastic/agent/server/api.py:753] Received 15 death signal, "
            "shutting down workers\n"
            "W1201 10:00:06.000000 1200 torch/distributed/elastic/multiprocessing/api.py:1029] Sending process 1234 "
            "closing signal SIGTERM\n")
    rc = _root(tmp_path, text)
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("python.exception", "python_exception", 2, 4)


def _summary_entry(index: int, rank: int, exitcode: str, frames: list[str], exception: str) -> str:
    lines = [f"[{index}]:", "  time      : 2026-12-02_05:25:30", "  host      : node01",
             f"  rank      : {rank} (local_rank: {rank})", f"  exitcode  : {exitcode}",
             f"  error_file: /tmp/torchelastic_x/attempt_0/{rank}/error.json",
             "  traceback : Traceback (most recent call last):", *(f"    {frame}" for frame in frames),
             f"  {exception}"]
    return "\n".join(lines) + "\n"


def _summary(*entries: str) -> str:
    rule, dash = "=" * 60, "-" * 60
    return ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
            f"{rule}\ntrain.py FAILED\n{dash}\nFailures:\n" + "".join(entries[1:])
            + f"{dash}\nRoot Cause (first observed failure):\n" + entries[0] + f"{rule}\n")


def test_an_error_files_exception_in_the_summary_is_that_entrys_rank(tmp_path):
    # `--local-ranks-filter 0,1` hid rank 2, which wrote the checkpoint and ran out of disk; ranks 0
    # and 1 then could not read the cut file (cpu_adhoc ckpt_partial_*: torchrun 2.13's summary layout)
    corrupt = ("RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory. "
               "This is an internal miniz error.")
    console = "".join(f"[rank{r}]: Traceback (most recent call last):\n[rank{r}]:   File \"train.py\", line 9, in main\n"
                      f"[rank{r}]:     net.load_state_dict(torch.load(shared))\n[rank{r}]: {corrupt}\n" for r in (0, 1))
    log = console + _summary(
        _summary_entry(0, 0, "1 (pid: 101)", ['File "train.py", line 9, in main'], corrupt),
        _summary_entry(1, 1, "1 (pid: 102)", ['File "train.py", line 9, in main'], corrupt),
        _summary_entry(2, 2, "-15 (pid: 103)  (SIGTERM)", ['File "train.py", line 7, in save'],
                       "OSError: [Errno 28] No space left on device: '/ckpt/shared_step2.pt'"))
    rc = _root(tmp_path, log)
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["exception_type"]) == ("ckpt.write_failed", "checkpoint", 2,
                                                                                  "OSError")


def test_the_one_rank_whose_error_file_waited_in_another_collective(tmp_path):
    # every rank timed out; the summary's error files show rank 0 in `barrier` (its save branch) and
    # the others in DDP's backward (cpu_adhoc save_barrier_*)
    timeout = "RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 15000ms for recv operation to complete"
    barrier = ['File "train.py", line 133, in main', 'File "/venv/torch/distributed/distributed_c10d.py", line 5356, in barrier']
    backward = ['File "train.py", line 120, in main', 'File "/venv/torch/autograd/graph.py", line 829, in _engine_run_backward']
    log = _summary(_summary_entry(0, 0, "1 (pid: 101)", barrier, timeout),
                   *(_summary_entry(r, r, "1 (pid: 10%d)" % r, backward, timeout) for r in (1, 2, 3)))
    rc = _root(tmp_path, log)
    assert (rc["rule_id"], rc["rank"]) == ("gloo.timeout", 0)


def test_ranks_that_all_waited_for_one_ranks_address_name_that_rank(tmp_path):
    # rank 2 took rank 3's number (a stale RANK), so nobody published rank 2's address: every rank
    # times out waiting for its key (cpu_adhoc dup_rank_np4_r2_plain, torch 2.13's gloo)
    wait = "torch.distributed.DistStoreError: wait timeout after 15000ms, keys: /default_pg/0//cpu//0/2"
    rc = _root(tmp_path, "".join(f"[rank{r}]: {wait}\n" for r in range(4)))
    assert (rc["rule_id"], rc["rank"], rc["ranks"]) == ("dist.store_wait_timeout", 2, [0, 1, 2, 3])


def test_torchruns_own_signal_exception_types_its_death_signal_line(tmp_path):
    # `timeout -s TERM 20 torchrun ...` (cpu_adhoc agent_term_np4_rall_plain): the agent's notice is
    # the root, its SignalException traceback a few lines later gives the type
    log = ("W1202 05:45:08.352000 2591 torch/distributed/elastic/agent/server/api.py:753] Received 15 death "
           "signal, shutting down workers\n"
           "W1202 05:45:08.353000 2591 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 2597 "
           "closing signal SIGTERM\nTraceback (most recent call last):\n"
           '  File "/tmp/venv/bin/torchrun", line 6, in <module>\n    sys.exit(main())\n'
           "torch.distributed.elastic.multiprocessing.api.SignalException: Process 2591 got signal: 15\n")
    rc = _root(tmp_path, log)
    assert (rc["rule_id"], rc["line"], rc["exception_type"]) == (
        "launcher.signal_exception", 1, "torch.distributed.elastic.multiprocessing.api.SignalException")
