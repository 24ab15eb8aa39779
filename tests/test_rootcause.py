"""Root-cause choices on small logs built from real message formats (each case names its source)."""

from __future__ import annotations

import re

from logtriage.api import triage


def _report(log, text: str) -> dict:
    """Write `text` as the log and triage it: the JSON report."""
    log.write_text(text)
    return triage([str(log)]).to_dict()


def _traceback(path: str, line: int, function: str, code: str, *tail: str) -> str:
    """A one-frame Python traceback as printed, then its exception line(s)."""
    return (f'Traceback (most recent call last):\n  File "{path}", line {line}, in {function}\n    {code}\n'
            + "".join(t + "\n" for t in tail))


def _summary(entry: str, failures: tuple[int, ...], root: int) -> str:
    """torchelastic's ChildFailedError block: `entry` (with {i} and {r}) for each failed rank
    under Failures, then the Root Cause entry."""
    rule = "------------------------------------------------------------\n"
    return ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
            "============================================================\ntrain FAILED\n" + rule + "Failures:\n"
            + "".join(entry.format(i=i, r=r) for i, r in enumerate(failures, 1)) + rule
            + "Root Cause (first observed failure):\n" + entry.format(i=0, r=root)
            + "============================================================\n")


def test_the_exception_line_is_reported_not_the_raise_line_above_it(tmp_path):
    # a rule that names the exception type also matches the frame's code line `raise X(`
    log = tmp_path / "r.log"
    rc = _report(log, 'Traceback (most recent call last):\n  File "/x/api.py", line 3, in f\n'
                      "    raise RendezvousConnectionError(\n"
                      "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the "
                      "C10d store has failed.\n")["root_cause"]
    assert (rc["rule_id"], rc["line"]) == ("dist.rendezvous_connection", 4)


def _timeouts_log(tmp_path, world: int, reporting: list[int]):
    lines = [f"world_size={world}"]
    for r in reporting:
        lines.append(f"[rank{r}]:[E1130 10:00:0{r}.000000000 ProcessGroupNCCL.cpp:632] [Rank {r}] Watchdog caught "
                     f"collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
                     f"Timeout(ms)=600000) ran for 600001 milliseconds before timing out.")
    log = tmp_path / "t.log"
    return _report(log, "\n".join(lines) + "\n")["root_cause"]


def test_ranks_missing_from_a_timeout_name_one_culprit_only_when_one_is_missing(tmp_path):
    rc = _timeouts_log(tmp_path, 4, [0, 1, 2])
    assert (rc["category"], rc["rank"], rc["ranks"]) == ("collective_timeout", 3, [3])
    rc = _timeouts_log(tmp_path, 8, [1, 2, 3])          # rank 0 among the silent: the usual laggard
    assert (rc["rank"], rc["ranks"]) == (0, [0, 4, 5, 6, 7])
    rc = _timeouts_log(tmp_path, 8, [0, 1, 2, 3])       # four silent ranks, none of them 0: no guess
    assert (rc["rank"], rc["ranks"]) == (None, [4, 5, 6, 7])



def test_receivers_timed_out_in_a_broadcast_wait_for_its_source(tmp_path):
    # NVlabs/stylegan3#48 (sample_logs/public35/stylegan3_48_*): rank 1's gloo recv timed out in
    # `broadcast(param, src=0)` while rank 0 was still building a plugin; no line names a rank
    def broadcast(src: int) -> str:
        return ("Traceback (most recent call last):\n"
                '  File "/w/stylegan3/training/training_loop.py", line 188, in training_loop\n'
                f"    torch.distributed.broadcast(param, src={src})\n"
                '  File "/env/lib/site-packages/torch/distributed/distributed_c10d.py", line 868, in broadcast\n'
                "    work.wait()\n"
                "RuntimeError: [../third_party/gloo/gloo/transport/uv/unbound_buffer.cc:67] Timed out waiting "
                "1800000ms for recv operation to complete\n")
    log = tmp_path / "b.log"
    rc = _report(log, 'Setting up PyTorch plugin "filtered_lrelu_plugin"... ' + broadcast(0))["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["line"]) == ("gloo.timeout", 0, 6)
    log.write_text(broadcast(0) + broadcast(1))     # two sources: nothing says which one was late
    assert triage([str(log)]).to_dict()["root_cause"]["rank"] is None


def test_an_nccl_warning_belongs_to_the_worker_whose_pid_the_launcher_names(tmp_path):
    # NCCL's `host:pid:tid [dev]` prefix (nvidia/nccl src/debug.cc) with no set-up lines naming the
    # process's rank: the agent's `failed ... local_rank: 2 (pid: 23458)` does (FORMATS.md §2.2)
    log = tmp_path / "n.log"
    rc = _report(log,
        "[rank0]: step 10 loss 2.31\n"
        "node1:23458:23502 [2] include/alloc.h:125 NCCL WARN Cuda failure 'out of memory'\n"
        "[rank0]:[E1130 10:30:00.000000000 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective "
        "operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) "
        "ran for 600001 milliseconds before timing out.\n"
        "E1130 10:31:00.000000 23400 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: 1) "
        "local_rank: 2 (pid: 23458) of binary: /usr/bin/python3\n")["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["line"]) == ("cuda.oom", 2, 2)


def test_cudas_initialization_error_in_a_dataloader_worker_is_cuda_after_fork(tmp_path):
    # torch/_utils.py ExceptionWrapper's re-raise; the cause as in pytorch/pytorch#2517 (a Dataset
    # that moves samples to the GPU, workers forked from a process that had initialised CUDA)
    worker = ("[rank1]: Traceback (most recent call last):\n"
              '[rank1]:   File "/w/train.py", line 120, in <module>\n'
              "[rank1]:     for batch in loader:\n"
              '[rank1]:   File "/env/torch/_utils.py", line 706, in reraise\n'
              "[rank1]:     raise exception\n"
              "[rank1]: RuntimeError: Caught RuntimeError in DataLoader worker process 0.\n"
              "[rank1]: Original Traceback (most recent call last):\n"
              '[rank1]:   File "/env/torch/utils/data/_utils/worker.py", line 309, in _worker_loop\n'
              "[rank1]:     data = fetcher.fetch(index)\n"
              '[rank1]:   File "/w/data.py", line 44, in __getitem__\n'
              "[rank1]:     img = torch.from_numpy(arr).cuda()\n"
              "[rank1]: RuntimeError: CUDA error: initialization error\n")
    log = tmp_path / "w.log"
    rc = _report(log, worker)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("cuda.forked_subprocess", "launch_usage", 1, 12)
    again = _report(log, worker.split("[rank1]: RuntimeError: Caught")[0]
                    + "[rank1]: RuntimeError: CUDA error: initialization error\n")
    assert again["root_cause"]["category"] == "environment"   # the process's own CUDA


def test_a_json_decode_error_is_a_banner_before_a_probe_only_where_the_log_shows_a_banner(tmp_path):
    # error manual E007 (shared/seeds/000_*: an NGC banner in front of the probe's JSON) against
    # FasterDecoding/Medusa#12 (sample_logs/public38/medusa12_*: a dataset that was a git-lfs pointer)
    error = ('Traceback (most recent call last):\n  File "/w/train.py", line 17, in make_data\n'
             '    train_json = json.load(open(data_args.data_path, "r"))\n'
             "json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)\n")
    log = tmp_path / "j.log"
    rc = _report(log, error)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["line"]) == ("python.exception", "python_exception", 4)
    rc = _report(log, "==========\n== PyTorch ==\n==========\n\nNVIDIA Release 24.01 (build 80741402)\n"
                 + error)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["line"]) == ("env.probe_json", "environment", 9)


def test_an_error_the_program_fell_back_from_is_not_the_root(tmp_path):
    # a DeepSpeed run's log (sample_logs/public37/madeline_*): FusedAdam's ninja build failed,
    # DeepSpeed fell back to torch's Adam, and the run died later of a CUDA OOM
    build = ("ninja: build stopped: subcommand failed.\n"
             "), falling back to torch.optim.AdamW / torch.optim.Adam.\n")
    oom = ("[rank1]: Traceback (most recent call last):\n"
           '[rank1]:   File "/w/train.py", line 90, in <module>\n'
           "[rank1]:     model_engine.step()\n"
           "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.44 GiB. GPU 1 has a total "
           "capacity of 10.75 GiB of which 748.75 MiB is free.\n")
    log = tmp_path / "f.log"
    rc = _report(log, build + "[Rank 0] step 1 loss 3.2\n" + oom)["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["line"]) == ("cuda.oom", 1, 7)
    log.write_text(build)   # nothing else failed: the build failure is all there is
    assert triage([str(log)]).to_dict()["root_cause"]["rule_id"] == "env.build_ext_failed"


def test_a_launcher_stopping_its_workers_with_no_error_is_a_failure_without_evidence(tmp_path):
    # DeepSpeed's launcher (sample_logs/public39/wizardlm_93_*) and torch 1.8's launch.py
    # (public39/openlane_26_*) kill the other workers after one failed; the failure is not shown
    log = tmp_path / "k.log"
    d = _report(log, "Parameter Offload: Total persistent parameters: 2725888 in 322 params\n"
                     "[2023-06-25 10:47:37,222] [INFO] [launch.py:428:sigkill_handler] Killing subprocess 31472\n"
                     "[2023-06-25 10:47:48,634] [INFO] [launch.py:428:sigkill_handler] Killing subprocess 31473\n")
    assert (d["verdict"], d["root_cause"]["category"], d["root_cause"]["rank"], d["root_cause"]["line"]) == (
        "failed", "unknown", None, 2)
    again = _report(log, "Loading Dataset ...\nKilling subprocess 6040\nKilling subprocess 6041\n")
    assert (again["verdict"], again["root_cause"]["rule_id"], again["root_cause"]["line"]) == (
        "failed", "launcher.sigterm_sent", 2)


def test_pytorchs_test_harness_reports_belong_to_the_process_they_name(tmp_path):
    # pytorch/pytorch#60652 (sample_logs/public38/pytorch60652_*): MultiProcessTestCase ends its
    # own exception with the child's; deepspeedai/DeepSpeed#5330's pytest summary lines
    log = tmp_path / "h.log"
    rc = _report(log, _traceback("common_distributed.py", 633, "_check_return_codes", "raise RuntimeError(error)",
                                 "RuntimeError: Process 0 exited with error code 10 and exception:",
                                 "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed "
                                 "by peer [172.17.0.2]:21400"))["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["line"]) == ("gloo.connection_closed", 0, 5)
    rc = _report(log, "FAILED unit/comm/test_dist.py::TestDistAllReduce::test - torch.distributed.DistBackendError: "
                      "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1691, internal error, "
                      "NCCL version 2.17.1\n")["root_cause"]
    assert (rc["rule_id"], rc["exception_type"]) == ("nccl.internal_error", "torch.distributed.DistBackendError")


def test_losing_the_store_while_fetching_nccls_id_points_at_rank_0(tmp_path):
    # Blealtan/RWKV-LM-LoRA#12 (sample_logs/public41/rwkvlmlora_12_*): the only line is rank 1's
    line = ("RuntimeError: [1] is setting up NCCL communicator and retrieving ncclUniqueId from [0] via c10d key-value "
            "store by key '0', but store->get('0') got error: {reason}.  This may indicate a possible application "
            "crash on rank 0 or a network set up issue.\n")
    log = tmp_path / "u.log"
    rc = _report(log, line.format(reason="Connection reset by peer"))["root_cause"]
    assert (rc["category"], rc["rank"], rc["line"]) == ("unknown", 0, 1)
    log.write_text(line.format(reason="wait timeout after 600000ms"))   # rank 0 was late, not gone
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("nccl.unique_id_timeout", 0)


def test_an_oom_on_gpu_k_with_no_rank_named_is_local_rank_k_except_under_ray(tmp_path):
    # Lightning-AI/litgpt#191 (sample_logs/public41/litgpt_191_*): Fabric puts local rank k on cuda:k
    line = ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 792.00 MiB. GPU {k} has a total "
            "capacty of 31.74 GiB of which 573.12 MiB is free.\n")
    log = tmp_path / "o.log"
    rc = _report(log, line.format(k=6))["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("cuda.oom", 6)
    assert _report(log, line.format(k=0))["root_cause"]["rank"] == 0
    log.write_text("(RayTrainWorker pid=1234, ip=10.0.0.5) " + line.format(k=0))   # each Ray worker's GPU is 0
    assert triage([str(log)]).to_dict()["root_cause"]["rank"] is None
    log.write_text("".join(f"node0{n}: " + line.format(k=6) for n in (1, 2, 3)))   # pdsh nodes: 6 is local
    assert triage([str(log)]).to_dict()["root_cause"]["rank"] is None


def test_two_processes_on_one_gpu_in_nccls_summaries_is_a_device_assignment(tmp_path):
    # amazon-science/polygon-transformer#29 (sample_logs/public41/polygontransformer_29_*)
    summary = "host:{pid}:{pid} [0] NCCL INFO comm 0x55dd{pid} rank {rank} nranks 2 cudaDev 0 busId {bus} - Abort COMPLETE\n"
    cut = 'Traceback (most recent call last):\n  File "train.py", line 9, in <module>\n'
    log = tmp_path / "g.log"
    rc = _report(log, summary.format(pid=3639, rank=0, bus="19000")
                 + summary.format(pid=3640, rank=1, bus="19000") + cut)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["ranks"], rc["line"]) == ("nccl.duplicate_gpu", "device_assignment", [0, 1], 1)
    again = _report(log, summary.format(pid=3639, rank=0, bus="19000")
                    + summary.format(pid=3640, rank=1, bus="1a000") + cut)
    assert again["root_cause"]["category"] != "device_assignment"   # two GPUs


def test_a_file_system_error_on_a_checkpoint_path_or_a_traceback_cut_inside_torch_load(tmp_path):
    # huggingface/trl#2928 (sample_logs/public42/trl_2928_*): ranks racing to rename a checkpoint;
    # pytorch/pytorch#103895 (public42/pytorch_103895_*): the traceback ends inside torch.load
    log = tmp_path / "c.log"
    rc = _report(log, "[rank5]: OSError: [Errno 39] Directory not empty: 'output_dir/tmp-checkpoint-l6bxw431' -> "
                      "'output_dir/checkpoint-100'\n")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("ckpt.io_error", "checkpoint", 5)
    frames = ('Traceback (most recent call last):\n  File "/w/train.py", line 9, in main\n    {call}\n'
              '  File "/env/{path}", line 777, in {func}\n    x = f()\n')
    again = _report(log, frames.format(call="engine.load_checkpoint(d)", path="torch/serialization.py", func="load"))
    assert again["root_cause"]["category"] == "checkpoint"
    # activation checkpointing recomputes a forward pass: a traceback cut there is not a checkpoint file's
    again = _report(log,
                    frames.format(call="out = checkpoint(block, x)", path="torch/utils/checkpoint.py", func="checkpoint"))
    assert again["root_cause"]["category"] == "unknown"


def test_a_valueerror_in_torchruns_own_option_parsing_is_a_launch_usage_error(tmp_path):
    # open-mmlab/mmaction2#1476 (sample_logs/public43/mmaction2_1476_*): dist_train.sh's arguments
    # shifted, so `--work-dir` landed in --nproc_per_node
    log = tmp_path / "n.log"
    rc = _report(log, _traceback("/env/torch/distributed/run.py", 564, "determine_local_world_size",
                                 "return int(nproc_per_node)",
                                 "ValueError: invalid literal for int() with base 10: '--work-dir'"))["root_cause"]
    assert (rc["rule_id"], rc["category"]) == ("launcher.torchrun_usage", "launch_usage")
    # the same ValueError followed by the launcher's chained traceback: its own frame still counts
    rc = _report(log, log.read_text() + "\nDuring handling of the above exception, another exception occurred:\n\n"
                      'Traceback (most recent call last):\n  File "/env/runpy.py", line 193, in _run_module_as_main\n'
                      '    "__main__", mod_spec)\n')["root_cause"]
    assert (rc["rule_id"], rc["line"]) == ("launcher.torchrun_usage", 4)


def test_an_exception_whose_message_starts_on_the_next_line_is_read_with_it(tmp_path):
    # torch 1.x's driver check (sample_logs/public43/trixie_9_*): `AssertionError: ` then the message
    log = tmp_path / "a.log"
    rc = _report(log, _traceback("/env/torch/cuda/__init__.py", 63, "_check_driver", "raise AssertionError(msg)",
                                 "AssertionError: ",
                                 "The NVIDIA driver on your system is too old (found version 10010)."))["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["exception_type"]) == ("cuda.driver_unusable", "environment", "AssertionError")

def test_a_scheduler_memory_kill_explains_the_stop_signal_before_it(tmp_path):
    # Slurm stops the job (torchrun gets SIGTERM), then slurmstepd says why: the OOM is the root
    log = tmp_path / "s.log"
    rc = _report(log,
        "W1130 10:00:00.000000 100 torch/distributed/elastic/agent/server/api.py:700] Received Signals.SIGTERM "
        "death signal, shutting down workers\n"
        "torch.distributed.elastic.multiprocessing.api.SignalException: Process 100 got signal: 15\n"
        "slurmstepd: error: Detected 1 oom_kill event in StepId=123.0. Some of the step tasks have been OOM "
        "Killed.\n")["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["line"]) == ("host_oom", "sched.slurm_oom_kill", 3)
    again = _report(log, "torch.distributed.elastic.multiprocessing.api.SignalException: Process 100 got signal: 15\n")
    assert again["root_cause"]["category"] == "external_stop"


def test_lightning_all_registered_means_the_group_formed(tmp_path):
    # Lightning-AI/pytorch-lightning#9641: rank 0's MEMBER line is above the paste
    log = tmp_path / "l.log"
    report = _report(log, "initializing ddp: GLOBAL_RANK: 1, MEMBER: 2/2\n" + "-" * 100 + "\n"
                          "distributed_backend=nccl\nAll DDP processes registered. Starting ddp with 2 processes\n"
                          + "-" * 100 + "\n")
    assert (report["verdict"], report["root_cause"]["rule_id"]) == ("hung", "hang.after_nccl_init")
    log.write_text("initializing ddp: GLOBAL_RANK: 1, MEMBER: 2/2\n")   # without the banner: rank 0 never came
    report = triage([str(log)]).to_dict()
    assert (report["verdict"], report["root_cause"]["rule_id"]) == ("hung", "hang.world_not_joined")
    assert report["root_cause"]["ranks"] == [0]


def test_missing_members_are_a_hang_repeated_ones_a_launch_mistake(tmp_path):
    # Lightning-AI/pytorch-lightning#19606 (one member of five, then silence) against #10098
    # (two nodes both claim global ranks 0-3 of 8)
    log = tmp_path / "l.log"
    rc = _report(log, "[rank: 0] Seed set to 42\nInitializing distributed: GLOBAL_RANK: 0, MEMBER: 1/5\n")["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["ranks"]) == ("hang", "hang.world_not_joined", [1, 2, 3, 4])
    rc = _report(log,
                 "".join(f"initializing ddp: GLOBAL_RANK: {r}, MEMBER: {r + 1}/8\n" for r in (0, 1, 2, 3) * 2))["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["ranks"]) == ("launch_usage", "launcher.world_incomplete", [0, 1, 2, 3])


def test_a_file_system_error_inside_a_checkpoint_save_is_a_checkpoint_failure(tmp_path):
    # NVIDIA/DeepLearningExamples#1092: every node's local rank 0 replaced the same symlink
    frames = ('[rank1]: Traceback (most recent call last):\n'
              '[rank1]:   File "train.py", line 300, in <module>\n'
              '[rank1]:   File "train.py", line 229, in {func}\n'
              '[rank1]:     os.symlink(src, dst)\n'
              "[rank1]: {error}\n")
    log = tmp_path / "c.log"
    rc = _report(log,
                 frames.format(func="save_checkpoint", error="FileExistsError: [Errno 17] File exists: 'last.pt'"))["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["rank"], rc["line"]) == ("checkpoint", "ckpt.io_error", 1, 5)
    again = _report(log,
                    frames.format(func="load_checkpoint", error="FileNotFoundError: [Errno 2] No such file: 'last.pt'"))
    assert again["root_cause"]["rule_id"] == "ckpt.not_found"
    # the same error outside any checkpoint frame stays what it is; so does a bug inside one
    again = _report(log, frames.format(func="build_dataset", error="FileExistsError: [Errno 17] File exists: 'cache'"))
    assert again["root_cause"]["category"] == "python_exception"
    again = _report(log, frames.format(func="save_checkpoint", error="KeyError: 'optimizer'"))
    assert again["root_cause"]["category"] == "python_exception"


def test_pickle_refusing_an_object_inside_torch_save_is_the_saves_failure(tmp_path):
    # sample_logs/cpu_adhoc/save_lambda_*: torch.save of a whole module holding a lambda; the same
    # error from all_gather_object (pickle_np3_r1_tee) is the script's, not a checkpoint's
    frames = ('[rank3]: Traceback (most recent call last):\n'
              '[rank3]:   File "/tmp/job/train.py", line 98, in step\n'
              '[rank3]:   File "/tmp/venv/lib/python3.11/site-packages/torch/{path}", line 1003, in {func}\n'
              "[rank3]: AttributeError: Can't pickle local object 'step.<locals>.<lambda>'\n")
    log = tmp_path / "p.log"
    rc = _report(log, frames.format(path="serialization.py", func="save"))["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["rank"], rc["exception_type"]) == (
        "checkpoint", "ckpt.save_refused", 3, "AttributeError")
    rc = _report(log, frames.format(path="distributed/distributed_c10d.py", func="all_gather_object"))["root_cause"]
    assert (rc["category"], rc["rule_id"]) == ("python_exception", "python.exception")


def test_an_abort_after_the_watchdogs_dump_signal_is_the_timeouts_teardown(tmp_path):
    # ProcessGroupNCCL's texts (torch 2.4+, ProcessGroupNCCL.cpp): rank 3 detected the timeout,
    # rank 1 was told to dump and then terminated; nothing names the rank that hung
    log = tmp_path / "dump.log"
    report = _report(log,
        "[rank1]:[E703 21:51:54.112142364 ProcessGroupNCCL.cpp:1987] [PG ID 0 PG GUID 0(default_pg) Rank 1] "
        "Received a dump signal due to a collective timeout from  rank 3 and we will try our best to dump the "
        "debug info. Last enqueued NCCL work: 56116, last completed NCCL work: 56116.\n"
        "[rank1]:[F703 21:52:54.112142364 ProcessGroupNCCL.cpp:1555] [PG ID 0 PG GUID 0(default_pg) Rank 1] "
        "Terminating the process after attempting to dump debug info, due to collective timeout or exception.\n"
        "E0703 21:52:58.000000 4242 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: -6) "
        "local_rank: 1 (pid: 4243) of binary: /usr/bin/python\n")
    rc = report["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["rank"], rc["line"]) == ("collective_timeout", "nccl.flight_recorder", None, 1)
    assert [(c["rule_id"], c["role"]) for c in report["chain"]] == [("nccl.flight_recorder", "initiating"),
                                                                    ("signal.sigabrt", "cascade")]


def test_ray_workers_that_cannot_be_scheduled_are_a_hang(tmp_path):
    # ray-project/ray#19919: Ray Train asked for a GPU the cluster did not have, and waited
    log = tmp_path / "ray.log"
    report = _report(log, "2021-10-30 18:07:43,365 INFO trainer.py:145 -- Trainer logs will be logged in: /tmp/r\n"
                          "(scheduler +17s) Warning: The following resource request cannot be scheduled right now: "
                          "{'GPU': 1.0, 'CPU': 1.0}. This is likely due to all cluster resources being claimed by actors.\n")
    rc = report["root_cause"]
    assert (report["verdict"], rc["category"], rc["rule_id"], rc["line"]) == ("hung", "hang", "hang.ray_unschedulable", 2)


def test_the_end_of_a_log_without_known_errors(tmp_path):
    """An error no rule knows at the log's end fails the run; a warning, a shutdown note or an
    error followed by progress does not; with none, output that just stops is a hang."""
    log = tmp_path / "end.log"
    cases = [
        ("Loading model\nWeird failure: the frobnicator failed to start\n", "failed", "unknown.error_line", 2),
        ("[rank0]: step 3 loss 0.2\n[rank0]: Exception ignored in: <function _MultiProcessingDataLoaderIter.__del__>\n",
         "hung", "hang.output_stopped", 2),
        ("UserWarning: Failed to load image Python extension\n[rank0]: step 1 loss 0.3\n[rank0]: step 2 loss 0.2\n",
         "hung", "hang.output_stopped", 3),
        ("node:1:1 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>\n"
         "node:1:1 [0] NCCL WARN Failed to open libibverbs.so[.1]\n", "hung", "hang.nccl_init_stalled", None),
        ("[rank0]: step 5 loss 0.1\ntraining finished\n", "ok", None, None),
    ]
    for text, verdict, rule, line in cases:
        report = _report(log, text)
        rc = report["root_cause"] or {}
        assert (report["verdict"], rc.get("rule_id")) == (verdict, rule), text
        if line is not None:
            assert rc["line"] == line, text


def test_ranks_in_different_collectives_at_one_seq_are_a_mismatch(tmp_path):
    # pytorch/pytorch#20630's shape: ranks 1-2 wait in ALLREDUCE #4084, rank 3 in BROADCAST #4084
    line = ("[rank{r}]:[E ProcessGroupNCCL.cpp:828] [Rank {r}] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=4084, OpType={op}, NumelIn={n}, NumelOut={n}, Timeout(ms)=600000) ran for 600077 "
            "milliseconds before timing out.\n")
    log = tmp_path / "m.log"
    rc = _report(log, line.format(r=1, op="ALLREDUCE", n=4821568) + line.format(r=2, op="ALLREDUCE", n=4821568)
                      + line.format(r=3, op="BROADCAST", n=56623104))["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["rank"]) == ("collective_mismatch", "dist.collective_mismatch", 3)
    again = _report(log, line.format(r=1, op="ALLREDUCE", n=4821568) + line.format(r=2, op="ALLREDUCE", n=4821568))
    assert again["root_cause"]["category"] == "collective_timeout"


def test_two_ranks_timed_out_at_different_seqs_in_different_ops_are_a_mismatch(tmp_path):
    # sample_logs/public28/torchtune1107_*: rank 1 waits in _ALLGATHER_BASE #313, rank 0 in ALLREDUCE #315
    line = ("[rank{r}]:[E ProcessGroupNCCL.cpp:607] [Rank {r}] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum={s}, OpType={op}, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600561 "
            "milliseconds before timing out.\n")
    log = tmp_path / "d.log"
    rc = _report(log, line.format(r=1, s=313, op="_ALLGATHER_BASE") + line.format(r=0, s=315, op="ALLREDUCE"))[
        "root_cause"]
    assert (rc["category"], rc["rank"], rc["ranks"], rc["line"]) == ("collective_mismatch", None, [0, 1], 1)
    # the same op a few works apart, or a third rank's output in the log: not this reading
    same_op = _report(log, line.format(r=1, s=313, op="ALLREDUCE") + line.format(r=0, s=315, op="ALLREDUCE"))
    assert same_op["root_cause"]["category"] == "collective_timeout"
    third = _report(log, line.format(r=1, s=313, op="_ALLGATHER_BASE") + line.format(r=0, s=315, op="ALLREDUCE")
                    + line.format(r=2, s=313, op="_ALLGATHER_BASE"))
    assert third["root_cause"]["category"] == "collective_timeout"


def test_a_ctrl_c_while_waiting_is_the_hang_it_stopped(tmp_path):
    # facebookresearch/detectron2#1286: mp.spawn's join sat in select() until the user pressed Ctrl-C
    frames = ("Traceback (most recent call last):\n"
              '  File "tools/train_net.py", line 161, in <module>\n    launch(main, args.num_gpus)\n'
              '  File "/usr/lib/python3.6/multiprocessing/connection.py", line 911, in wait\n'
              "    ready = selector.select(timeout)\n"
              '  File "/usr/lib/python3.6/selectors.py", line 376, in {func}\n'
              "    fd_event_list = self._poll.poll(timeout)\nKeyboardInterrupt\n")
    log = tmp_path / "c.log"
    report = _report(log, "[01/01 10:00:00 d2.engine.train_loop]: Starting training from iteration 0\n"
                     + frames.format(func="select"))
    assert (report["verdict"], report["root_cause"]["rule_id"]) == ("hung", "hang.stopped_while_waiting")
    log.write_text(frames.format(func="forward"))   # interrupted while computing: a stop, not a hang
    report = triage([str(log)]).to_dict()
    assert (report["verdict"], report["root_cause"]["category"]) == ("failed", "external_stop")


def test_a_sighup_the_launcher_forwards_is_an_outside_stop(tmp_path):
    # sample_logs/public23/firefly47_*: torchrun forwards the signal it received; SIGTERM is its own teardown
    line = "WARNING:torch.distributed.elastic.multiprocessing.api:Sending process {pid} closing signal {sig}\n"
    log = tmp_path / "hup.log"
    rc = _report(log, line.format(pid=53738, sig="SIGHUP") + line.format(pid=53740, sig="SIGHUP"))["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["line"]) == ("external_stop", "launcher.signal_exception", 1)
    # the launcher's own teardown: no outside stop is read from it, but a worker failed without a word here
    report = _report(log, line.format(pid=53738, sig="SIGTERM") + line.format(pid=53740, sig="SIGTERM"))
    assert (report["verdict"], report["root_cause"]["category"], report["root_cause"]["rule_id"]) == (
        "failed", "unknown", "launcher.sigterm_sent")


def test_a_store_timeout_after_training_started_is_a_peer_late_to_a_collective(tmp_path):
    # rwth-i6/returnn#1621 (sample_logs/public24/returnn1621_*): rank 0 alone ran dev evaluation; the
    # others' store wait (TORCH_DISTRIBUTED_DEBUG=DETAIL's fingerprint check) timed out
    error = ("RuntimeError: Socket Timeout\n"
             "Exception raised from doWait at ../torch/csrc/distributed/c10d/TCPStore.cpp:445 (most recent call first):\n")
    log = tmp_path / "store.log"
    rc = _report(log, "[rank0]: ep 1 dev eval, step 99, ce 0.286\n[rank1]: " + error.replace("\nE", "\n[rank1]: E")
                      + "[rank2]: " + error.replace("\nE", "\n[rank2]: E"))["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["rank"], rc["line"]) == (
        "collective_timeout", "dist.store_wait_in_collective", 0, 2)
    log.write_text("[rank1]: " + error.replace("\nE", "\n[rank1]: E"))   # at start-up: the rendezvous failed
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert rc["category"] == "rendezvous"


def test_an_exception_read_by_the_frame_that_raised_it(tmp_path):
    # mmcv's init_dist divides by torch.cuda.device_count() (sample_logs/public23/mmdet368_*);
    # a spawn child's EOFError in multiprocessing's _main is its parent's pickling failure
    log = tmp_path / "frame.log"
    rc = _report(log, _traceback("/usr/local/lib/python3.10/dist-packages/mmcv/runner/dist_utils.py", 31,
                                 "_init_dist_pytorch", "torch.cuda.set_device(rank % num_gpus)",
                                 "ZeroDivisionError: integer division or modulo by zero"))["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["line"]) == ("environment", "cuda.no_device", 4)
    spawn = ("Traceback (most recent call last):\n"
             '  File "<string>", line 1, in <module>\n'
             '  File "/usr/lib/python3.10/multiprocessing/spawn.py", line 116, in spawn_main\n'
             "    exitcode = _main(fd, parent_sentinel)\n"
             '  File "/usr/lib/python3.10/multiprocessing/spawn.py", line 126, in {func}\n'
             "    self = reduction.pickle.load(from_parent)\n"
             "EOFError: Ran out of input\n")
    rc = _report(log, spawn.format(func="_main"))["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["exception_type"]) == ("python_exception", "python.exception", "EOFError")
    log.write_text(spawn.format(func="load_checkpoint"))   # torch.load of an empty file: a checkpoint
    assert triage([str(log)]).to_dict()["root_cause"]["rule_id"] == "ckpt.corrupt_archive"


def test_a_hosts_local_ranks_map_to_the_global_ranks_its_lines_name(tmp_path):
    # sample_logs/cpu_matrix/nan_injection__loss_nan_np2-pdsh_nodes_tee3_np6_r4_m200200: pdsh labels
    # the host, --tee the local rank; rank 4 (worker-1's local rank 1) went NaN first
    lines = ["worker-0: [default0]:[rank 0] step 3 loss 0.2150 grad_norm nan",
             "worker-1: [default0]:[rank 3] step 3 loss 0.2462 grad_norm nan",
             "worker-1: [default1]:[rank 4] step 3 loss nan grad_norm nan",
             "worker-0: [default1]:[rank 1] step 3 loss 0.3101 grad_norm nan",
             "worker-0: [default1]:[rank 1] step 4 loss nan grad_norm nan",
             "worker-1: [default2]:[rank 5] step 4 loss nan grad_norm nan",
             "worker-0: [default2]:[rank 2] step 4 loss nan grad_norm nan"]
    log = tmp_path / "pdsh.log"
    report = _report(log, "\n".join(lines * 2) + "\n")
    rc = report["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["rank"], rc["line"]) == ("numerical", "numerical.loss_nan", 4, 3)
    assert {(r["rank"], r["host"]) for r in report["ranks"]} >= {(1, "worker-0"), (4, "worker-1")}


def test_a_workers_error_file_in_the_launchers_summary_is_its_failure(tmp_path):
    # pytorch/pytorch#73465 (sample_logs/public27/pytorch73465_*): only the summary was pasted;
    # @record put rank 304's traceback in the entry's `traceback :` field
    log = tmp_path / "cfe.log"
    rc = _report(log,
        "Root Cause (first observed failure):\n[0]:\n"
        "  time      : 2022-02-26_22:02:07\n  host      : host-a\n  rank      : 304 (local_rank: 0)\n"
        "  exitcode  : 1 (pid: 181845)\n  error_file: /tmp/torchelastic_x/attempt_0/0/error.json\n"
        "  traceback : Traceback (most recent call last):\n"
        '    File "pretrain_gpt.py", line 241, in main\n      die\n'
        "  NameError: name 'die' is not defined\n  \n" + "=" * 60 + "\n")["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["rank"], rc["line"], rc["exception_type"]) == (
        "python_exception", "python.exception", 304, 11, "NameError")
    # the exception is read by the catalog: a MemoryError there is host memory, not a Python bug
    rc = _report(log, log.read_text().replace("NameError: name 'die' is not defined", "MemoryError"))["root_cause"]
    assert (rc["category"], rc["rank"], rc["exception_type"]) == ("host_oom", 304, "MemoryError")


def test_a_key_missing_in_a_checkpoint_loader_and_a_loggers_ranked_traceback(tmp_path):
    # intelligent-machine-learning/dlrover#977 and facebookresearch/ParlAI#4452 (public27 samples)
    log = tmp_path / "ckpt.log"
    rc = _report(log, _traceback("/workspace/Megatron-LM/megatron/checkpointing.py", 526, "load_checkpoint",
                                 "iteration = state_dict['iteration']", "KeyError: 'iteration'"))["root_cause"]
    assert (rc["category"], rc["rule_id"]) == ("checkpoint", "ckpt.format_mismatch")
    rc = _report(log, "rank:  3 | 2022-04-03 18:44:26,615 CRITICAL | Traceback (most recent call last):\n"
                      '  File "parlai/core/torch_agent.py", line 2314, in backward\n    loss.backward()\n'
                      "RuntimeError: CUDA out of memory. Tried to allocate 21.06 GiB (GPU 3; 79.35 GiB total capacity; "
                      "63.19 GiB already allocated; 8.57 GiB free; 68.48 GiB reserved in total by PyTorch)\n")["root_cause"]
    assert (rc["category"], rc["rank"], rc["line"]) == ("gpu_oom", 3, 4)


def test_an_error_before_a_scheduler_time_limit_is_what_the_job_was_stuck_on(tmp_path):
    # sample_logs/public47/nccltest_*_rank10_then_time_limit: an InfiniBand completion error on rank
    # 10, then nothing until Slurm's time limit; Slurm's step id is no training step
    head = "10: node02:31641:31641 [2] NCCL INFO Broadcast: opCount 0 count 131072 datatype 7 op 0 root 0\n"
    error = ("10: node02:31641:32201 [0] transport/net_ib.cc:789 NCCL WARN NET/IB : Got completion with error 12, "
             "opcode 1, len 0, vendor err 129\n")
    stop = ("slurmstepd: error: *** JOB 416593 ON node01 CANCELLED AT 2020-01-27T14:51:17 DUE TO TIME LIMIT ***\n"
            " 0: slurmstepd: error: *** STEP 416593.0 ON node01 CANCELLED AT 2020-01-27T14:51:17 DUE TO TIME LIMIT ***\n")
    log = tmp_path / "tl.log"
    report = _report(log, head * 3 + error + stop)
    rc = report["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["rank"], rc["line"]) == ("collective_error", "nccl.network_transport", 10, 4)
    assert all(r["last_step"] is None for r in report["ranks"])
    # without the error, the time limit is the stop
    rc = _report(log, head * 3 + stop)["root_cause"]
    assert (rc["category"], rc["rule_id"]) == ("external_stop", "sched.slurm_time_limit")


def test_the_rank_whose_progress_went_its_own_way_is_the_peer_that_left(tmp_path):
    # sample_logs/cpu_adhoc/no_sync_rank_np5_r4_spawn: rank 4 ran a step under no_sync() and got a
    # collective ahead; the only error is rank 0's lost connection, the script's prints say which
    prints = "".join(f"rank {r} step {s} loss 0.1\n" for s in (1, 2, 3, 4) for r in range(5)) + "rank 4 step 5 loss 0.1\n"
    closed = ("[rank0]: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
              "peer [127.0.0.1]:10967\n")
    log = tmp_path / "odd.log"
    rc = _report(log, prints + closed)["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["ranks"]) == ("gloo.connection_closed", 4, [4])
    # every rank at the same step: nothing says which peer left
    rc = _report(log, prints.replace("rank 4 step 5 loss 0.1\n", "") + closed)["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("gloo.connection_closed", 0)


def test_dcp_names_the_rank_whose_load_failed_on_every_rank(tmp_path):
    # sample_logs/cpu_adhoc/dcp_mismatch_np4_r2_tee: rank 2's dcp.load into a wider tensor; every
    # rank raises the same CheckpointException naming rank 2, and rank 0's copy prints first
    def rank_block(r):
        return (f"[rank{r}]: Traceback (most recent call last):\n"
                f'[rank{r}]:   File "/tmp/job/train.py", line 88, in main\n'
                f"[rank{r}]:     dcp.load(sd, checkpoint_id=ckpt)\n"
                f"[rank{r}]: torch.distributed.checkpoint.api.CheckpointException: CheckpointException ranks:dict_keys([2])\n"
                f"[rank{r}]: Traceback (most recent call last): (RANK 2)\n"
                f'[rank{r}]:   File "/tmp/venv/torch/distributed/checkpoint/default_planner.py", line 471, in create_local_plan\n'
                f"[rank{r}]:     raise ValueError(\n"
                f"[rank{r}]: ValueError: Size mismatch between saved torch.Size([4]) and current: torch.Size([6]) for head.w\n")
    log = tmp_path / "dcp.log"
    rc = _report(log, "".join(rank_block(r) for r in (0, 1, 3, 2)))["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["rank"], rc["ranks"], rc["line"]) == (
        "checkpoint", "ckpt.size_mismatch", 2, [2], 32)
    # under mp.spawn no copy carries a rank (sample_logs/cpu_adhoc/dcp_planner_np5_r4_spawn): the name stands
    bare = "".join(f"Process SpawnProcess-{r + 1}:\n" + rank_block(r).replace(f"[rank{r}]: ", "")
                   for r in (0, 1, 3, 2))
    rc = _report(log, bare)["root_cause"]
    assert (rc["category"], rc["rank"], rc["ranks"]) == ("checkpoint", 2, [2])


def test_a_store_client_still_retrying_when_the_log_ends_is_a_hang(tmp_path):
    # sample_logs/public114/internvla_* and public67/verl2492_*: the client's connect timed out and
    # it says it will try again; nothing after: the workers were still waiting for the store
    timeout = ("[E728 15:01:59.561275187 socket.cpp:1028] [c10d] The client socket has timed out after 600000ms "
               "while trying to connect to (127.0.0.1, 48315).\n")
    retry = ("[W728 15:01:59.562622567 TCPStore.cpp:340] [c10d] TCP client failed to connect/validate to host "
             "127.0.0.1:48315 - retrying (try=0, timeout=600000ms, delay=33924ms): The client socket has timed out "
             "after 600000ms while trying to connect to (127.0.0.1, 48315).\n"
             "Exception raised from throwTimeoutError at /pytorch/torch/csrc/distributed/c10d/socket.cpp:1013 "
             "(most recent call first):\n")
    log = tmp_path / "retry.log"
    report = _report(log, timeout + retry)
    assert (report["verdict"], report["root_cause"]["category"], report["root_cause"]["rule_id"]) == (
        "hung", "rendezvous", "dist.store_connect_timeout")
    # the client gave up: DistNetworkError after the retry note
    report = _report(log, timeout + retry + "torch.distributed.DistNetworkError: The client socket has timed out after "
                     "600000ms while trying to connect to (127.0.0.1, 48315).\n")
    assert (report["verdict"], report["root_cause"]["category"]) == ("failed", "rendezvous")


_GLOO_RECV_TIMEOUT = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                      "waiting 15000ms for recv operation to complete\n")


def _two_rank_timeouts(barrier_step: int, backward_step: int) -> str:
    # sample_logs/cpu_adhoc/accum_extra_np4_r3_filter (ranks 1-2 filtered out): rank 0 waits in the
    # barrier after its loop, rank 3 in DDP's backward (here rank 1, so that no rank is missing)
    prints = (f"rank 0 step {barrier_step} loss 0.1\nrank 1 step {backward_step} loss 0.1\n")
    barrier = ("[rank0]: Traceback (most recent call last):\n"
               '[rank0]:   File "/tmp/job/train.py", line 130, in main\n[rank0]:     dist.barrier()\n'
               '[rank0]:   File "/tmp/venv/torch/distributed/distributed_c10d.py", line 5356, in barrier\n'
               "[rank0]:     work.wait()\n[rank0]: " + _GLOO_RECV_TIMEOUT)
    backward = ("[rank1]: Traceback (most recent call last):\n"
                '[rank1]:   File "/tmp/job/train.py", line 127, in main\n[rank1]:     loss.backward()\n'
                '[rank1]:   File "/tmp/venv/torch/autograd/graph.py", line 979, in _engine_run_backward\n'
                "[rank1]:     return Variable._execution_engine.run_backward(\n[rank1]: " + _GLOO_RECV_TIMEOUT)
    return prints + barrier + backward


def test_of_two_timed_out_ranks_the_one_behind_in_the_loop_is_the_slow_one(tmp_path):
    log = tmp_path / "two.log"
    rc = _report(log, _two_rank_timeouts(barrier_step=5, backward_step=3))["root_cause"]
    assert (rc["category"], rc["rank"], rc["line"]) == ("collective_timeout", 1, 14)
    # the rank in the barrier printed fewer steps: it left the loop early (fewer batches)
    rc = _report(log, _two_rank_timeouts(barrier_step=3, backward_step=5))["root_cause"]
    assert (rc["category"], rc["rank"]) == ("collective_timeout", 0)


def test_an_abort_as_the_process_exits_after_its_exception_is_not_the_event(tmp_path):
    # sample_logs/cpu_adhoc/seed_check_np3_r2_tee: the AssertionError, then `terminate called
    # without an active exception` as the process exits with a thread still running (exit -6)
    log = tmp_path / "abort.log"
    rc = _report(log, "[default2]:[rank2]: Traceback (most recent call last):\n"
                      '[default2]:[rank2]:   File "/tmp/job/train.py", line 88, in main\n'
                      "[default2]:[rank2]:     assert same, msg\n"
                      "[default2]:[rank2]: AssertionError: rank 2: parameters differ from rank 0 after init\n"
                      "[default2]:terminate called without an active exception\n")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("python.assertion", "python_exception", 2, 4)


def test_a_ctrl_c_long_after_the_last_output_ended_a_hang(tmp_path):
    # sample_logs/public14/axolotl1563_*: `Starting trainer...` at 21:39:51, nothing, then the
    # user's Ctrl-C at 22:04:33
    def log_with(last: str) -> str:
        return (f"[2024-04-23 {last},276] [INFO] [axolotl.train.log:61] [PID:1486799] [RANK:0] Starting trainer...\n"
                "\n\n"
                "^C[2024-04-23 22:04:33,011] torch.distributed.elastic.agent.server.api: [WARNING] Received "
                "Signals.SIGINT death signal, shutting down workers\n"
                "[2024-04-23 22:04:33,012] torch.distributed.elastic.multiprocessing.api: [WARNING] Sending process "
                "1486799 closing signal SIGINT\n")
    log = tmp_path / "stall.log"
    report = _report(log, log_with("21:39:51"))
    assert (report["verdict"], report["root_cause"]["category"], report["root_cause"]["rule_id"]) == (
        "hung", "hang", "hang.stopped_while_waiting")
    # two minutes of quiet is a stop, not a stall
    report = _report(log, log_with("22:02:33"))
    assert (report["verdict"], report["root_cause"]["category"], report["root_cause"]["rule_id"]) == (
        "failed", "external_stop", "launcher.signal_exception")


def test_uneven_progress_is_no_hang_when_the_launcher_says_every_worker_finished(tmp_path):
    # docs/research/gaps29.md rows 34, 45: DeepSpeed's `Grad overflow on iteration 9` on one rank
    # reads as that rank's last step; the agent's success line says the run ended well
    ok = ("I1201 10:05:00.000000 1234 torch/distributed/elastic/agent/server/api.py:879] [default] worker group "
          "successfully finished. Waiting 300 seconds for other agents to finish.\n")
    steps = "[rank0]: step 100 loss 2.31\n[rank1]: step 12 loss 2.40\n[rank0]: step 200 loss 2.10\n"
    log = tmp_path / "fine.log"
    report = _report(log, steps + "[rank0]: training finished\n" + ok)
    assert (report["verdict"], report["root_cause"]) == ("ok", None)
    # without it, the same lines are a rank left behind
    assert _report(log, steps)["verdict"] == "hung"


def test_a_job_stopped_after_its_training_finished_had_hung_at_exit(tmp_path):
    # sample_logs/public111/megatronbridge1656_*: training done, then eight minutes of nothing
    # until Slurm's time limit; the processes never exited
    done = "[after training is done] datetime: 2025-12-03 14:45:03\n"
    finished = "training finished\n"
    stop = "slurmstepd: error: *** STEP 4226796.2 ON node01 CANCELLED AT 2025-12-03T14:53:02 DUE TO TIME LIMIT ***\n"
    log = tmp_path / "exit.log"
    report = _report(log, "step 100 loss 1.2\n" + finished + done + stop)
    rc = report["root_cause"]
    assert (report["verdict"], rc["category"], rc["rule_id"], rc["line"]) == ("hung", "hang", "hang.exit_stalled", 4)
    # an error after the finish line is no hang at exit; without the finish line the stop stands
    rc = _report(log, "step 100 loss 1.2\n" + finished + "RuntimeError: boom\n" + stop)["root_cause"]
    assert rc["rule_id"] != "hang.exit_stalled"
    report = _report(log, "step 100 loss 1.2\n" + stop)
    assert (report["verdict"], report["root_cause"]["rule_id"]) == ("failed", "sched.slurm_time_limit")


def test_the_what_line_of_a_terminate_is_the_event(tmp_path):
    # horovod/horovod#2074 (sample_logs/public48/horovod_2074_*): the CUDA error is only in `what():`
    log = tmp_path / "what.log"
    rc = _report(log, "[1,1]<stderr>:terminate called after throwing an instance of 'c10::Error'\n"
                      "[1,1]<stderr>:  what():  CUDA error: device not ready (Ready at horovod/torch/ready_event.cc:92)\n"
                      "[1,1]<stderr>:frame #0: c10::Error::Error(c10::SourceLocation, std::string const&) + 0x4e\n"
                 )["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["rank"], rc["line"]) == ("cuda_runtime", "cuda.error", 1, 2)
    # a what() no rule knows leaves the terminate as the event
    rc = _report(log, "terminate called after throwing an instance of 'std::out_of_range'\n"
                      "  what():  vector::_M_range_check\n")["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["line"]) == ("crash_signal", "signal.native_terminate", 1)


def test_a_finish_line_before_nccls_teardown_is_a_finished_run(tmp_path):
    # argonne-lcf/alcf-nccl-tests (sample_logs/public47/alcfnccl_*_completes_ok): the script's total
    # time, then NCCL tearing its communicators down
    init = "node01:3839890:3841322 [0] NCCL INFO comm 0x5603eacae150 rank 0 nranks 8 cudaDev 0 busId 7000 - Init COMPLETE\n"
    teardown = ("node01:3839893:3840156 [3] 152723.382768 nccl_net_ofi_closeRecv:3013 NCCL TRACE NET/OFI "
                "De-registering buffer for flush operations\n")
    log = tmp_path / "done.log"
    report = _report(log, init + "Total run time: 152.3959195613861 seconds\n" + teardown * 3)
    assert (report["verdict"], report["root_cause"]) == ("ok", None)
    report = _report(log, init + teardown * 3)
    assert (report["verdict"], report["root_cause"]["rule_id"]) == ("hung", "hang.after_nccl_init")


def test_a_message_glued_after_another_processs_progress_bar_is_read_alone(tmp_path):
    # a real CPU run (cpu_matrix batch 15, the tqdm variant): rank 1's watchdog line is glued after
    # rank 0's bar; the bar's own `rank 0:` is not the message's rank
    log = tmp_path / "bar.log"
    rc = _report(log, "\rrank 0:  50%|#####     | 3/6 [00:03<00:03,  1.01s/it][FATAL] 检测到训练卡死：超过 4.1 秒无 "
                      "Step 心跳，强行终止进程 (rank 1)\n")["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("hang.watchdog_heartbeat", 1)


def test_a_native_abort_glued_after_its_own_progress_bar_under_tee_is_one_event(tmp_path):
    # a real CPU run (cpu_matrix seed 3402, `--tee 3` with tqdm): torchrun's tee reads lines in text
    # mode, so each `\r` ends a line and the bar's last state carries the abort glued after it; the
    # `what():` line names gloo's size check
    log = tmp_path / "tee.log"
    rc = _report(log, "[default2]:rank 2:  17%|█▋        | 1/6 [00:00<00:01,  3.30it/s]\n"
                      "[default2]:rank 2:  33%|███▎      | 2/6 [00:00<00:00,  6.97it/s]terminate called after "
                      "throwing an instance of 'gloo::EnforceNotMet'\n"
                      "[default1]:[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read "
                      "error [127.0.0.1]:17802: Connection reset by peer\n"
                      "[default2]:  what():  [enforce fail at ../third_party/gloo/gloo/transport/tcp/pair.cc:456] "
                      "op.preamble.length <= op.nbytes. 8 vs 4. Received data size doesn't match expected size. Is "
                      "there a distributed collective mismatch in your code?\n")["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["line"]) == ("gloo.size_mismatch", 2, 4)


def test_a_file_system_error_in_a_module_named_for_checkpoints_is_a_checkpoint_failure(tmp_path):
    # facebookresearch/PyTorch-BigGraph#142 (sample_logs/public48/pbg_142_*): the partition file of
    # the checkpoint is not on this machine
    log = tmp_path / "pbg.log"
    rc = _report(log, _traceback("/env/torchbiggraph/checkpoint_storage.py", 341, "load_entity_partition",
                                 'with h5py.File(path, "r") as hf:',
                                 "OSError: Unable to open file (unable to open file: name = "
                                 "'/data/model/embeddings_x_1.v1.h5', errno = 2, error message = 'No such file or "
                                 "directory', flags = 0, o_flags = 0)"))["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["line"]) == ("checkpoint", "ckpt.io_error", 4)
    # fairscale's activation checkpointing recomputes a forward pass: no checkpoint file
    rc = _report(log, _traceback("/env/fairscale/nn/checkpoint/checkpoint_activations.py", 98, "forward",
                                 "outputs = run_function(*args)", "OSError: [Errno 5] Input/output error"))["root_cause"]
    assert (rc["category"], rc["rule_id"]) == ("environment", "host.filesystem_error")


def test_a_shared_exception_in_the_launchers_error_files_names_every_rank_that_raised_it(tmp_path):
    # pytorch/torchtitan run logs (sample_logs/public54/torchtitan_*): `--local-ranks-filter 0` shows
    # rank 0 only, the summary shows every rank's error file
    entry = ("[{i}]:\n  time      : 2026-05-19_21:22:15\n  host      : host-a\n  rank      : {r} (local_rank: {r})\n"
             "  exitcode  : 1 (pid: 41227{r})\n  error_file: /tmp/torchelastic/attempt_0/{r}/error.json\n"
             "  traceback : Traceback (most recent call last):\n"
             '    File "/x/torchtitan/trainer.py", line 689, in forward_backward_step\n'
             "  ModuleNotFoundError: No module named 'flash_attn_3'\n")
    log = tmp_path / "summary.log"
    rc = _report(log, "[rank0]:[rank0]: ModuleNotFoundError: No module named 'flash_attn_3'\n"
                      + _summary(entry, (1, 2), 0))["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["ranks"]) == ("python.module_not_found", 0, [0, 1, 2])


def test_srun_reporting_a_ranks_crash_confirms_that_ranks_own_earlier_error(tmp_path):
    # sample_logs/public47/nerscpt_*_no_route_to_host_*: rank 4's NCCL bootstrap error, then srun's
    # report that task 4 segfaulted; the report says how the rank ended, the error why
    log = tmp_path / "srun.log"
    report = ("4: node02:53622:56536 [0] include/socket.h:406 NCCL WARN Connect to 10.9.0.2<42427> failed : "
              "No route to host\n"
              "4: node02:53622:56536 [0] NCCL INFO bootstrap.cc:354 -> 2\n"
              "0: step 1 loss 0.25\n1: step 1 loss 0.25\n2: step 1 loss 0.25\n3: step 1 loss 0.25\n"
              "srun: error: node02: task 4: Segmentation fault\n")
    rc = _report(log, report)["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("nccl.bootstrap", 4)
    # with no error of its own before it, the crash the launcher reports is the root, with its rank
    rc = _report(log, "0: step 1 loss 0.25\n1: step 1 loss 0.25\n2: step 1 loss 0.25\n"
                      "srun: error: node02: task 1: Segmentation fault\n")["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("signal.sigsegv", 1)


def test_under_srun_torchrun_a_task_is_a_node_not_a_rank(tmp_path):
    # `srun --label torchrun --nnodes 2 --nproc_per_node 4`: srun's `task 1` is node 1's agent
    # (ranks 4-7), so srun's notices name no rank; the summary's rank 5 is the root
    log = tmp_path / "srun_torchrun.log"
    agent = "E1130 10:00:05.000000 2234 torch/distributed/elastic/multiprocessing/api.py:874] "
    body = ("1: Traceback (most recent call last):\n1:   File \"/work/train.py\", line 40, in <module>\n"
            "1: KeyError: 'target'\n"
            f"1: {agent}failed (exitcode: 1) local_rank: 1 (pid: 2240) of binary: /usr/bin/python\n"
            "1: torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
            "1: Root Cause (first observed failure):\n1: [0]:\n1:   host      : node2\n"
            "1:   rank      : 5 (local_rank: 1)\n1:   exitcode  : 1 (pid: 2240)\n"
            "srun: error: node2: task 1: Exited with exit code 1\n"
            "srun: error: node1: task 0: Exited with exit code 1\n")
    report = _report(log, "0: step 1 loss 2.3\n" + body)
    assert (report["root_cause"]["rule_id"], report["root_cause"]["rank"]) == ("python.exception", 5)
    srun = [c for c in report["chain"] if c["rule_id"] == "sched.srun_task_exit"]
    assert srun and all(c["ranks"] == [] for c in srun)
    assert {r["rank"] for r in report["ranks"]} == {5}
    # without srun's labels, torchelastic's summary shows the same
    report = _report(log, re.sub(r"(?m)^1: ", "", body))
    assert report["root_cause"]["rank"] == 5
    srun = [c for c in report["chain"] if c["rule_id"] == "sched.srun_task_exit"]
    assert srun and all(c["ranks"] == [] for c in srun)


def test_a_rank_that_timed_out_fetching_ncclUniqueId_waited_for_the_rank_it_names(tmp_path):
    # hiyouga/LlamaFactory#81 (sample_logs/public64/llamafactory81_*): the line without its `[N] is `
    log = tmp_path / "uid.log"
    rc = _report(log, "setting up NCCL communicator and retreiving ncclUniqueId from [0] via c10d key-value store "
                      "by key '0', but store->get('0') got error: Socket Timeout\n")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("nccl.unique_id_timeout", "collective_timeout", 0)


def test_a_warning_a_rule_reads_is_no_unknown_error_and_the_output_that_stops_after_it_is_a_hang(tmp_path):
    # aws/aws-ofi-nccl#174 (sample_logs/public64/awsofinccl174_*): no EFA, the plugin steps aside
    log = tmp_path / "ofi.log"
    report = _report(log, "algo-1:249:249 [0] ofi_init:1288 NCCL WARN NET/OFI Only EFA provider is supported\n"
                          "algo-1:249:249 [0] ofi_init:1339 NCCL WARN NET/OFI aws-ofi-nccl initialization failed\n")
    assert (report["verdict"], report["root_cause"]["rule_id"]) == ("hung", "hang.output_stopped")


def test_ranks_writing_their_exception_at_once_give_one_exception_type(tmp_path):
    # NVIDIA/TransformerEngine#651 (sample_logs/public66/transformerengine651_*): several ranks'
    # `RuntimeError: ` words ran together before one message; TE's cuDNN frontend error
    log = tmp_path / "glued.log"
    rc = _report(log, "RuntimeErrorRuntimeError: RuntimeError/deps/TransformerEngine/transformer_engine/common/"
                      "fused_attn/fused_attn_f16_arbitrary_seqlen.cu:227 in function operator(): cuDNN Error: "
                      "[cudnn_frontend] Error: No execution plans built successfully.. For more information, "
                      "enable cuDNN error logging\n")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["exception_type"]) == ("cuda.error", "cuda_runtime", "RuntimeError")


def test_a_checkpointers_own_check_of_its_path_is_a_missing_checkpoint(tmp_path):
    # torchtune training/checkpointing/_utils.py get_path (docs/research/gaps.md round 12, row 45):
    # a ValueError naming a missing path, raised in a package named for checkpoints
    log = tmp_path / "ttune.log"
    rc = _report(log, "[rank0]: Traceback (most recent call last):\n"
                      "[rank0]:   File \"/opt/conda/lib/python3.11/site-packages/torchtune/training/checkpointing/"
                      "_utils.py\", line 137, in get_path\n"
                      "[rank0]:     raise ValueError(f\"{input_dir} is not a valid directory.\")\n"
                      "[rank0]: ValueError: /tmp/Meta-Llama-3-8B is not a valid directory.\n")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("ckpt.not_found", "checkpoint", 0)
    # the same ValueError outside checkpoint code stays an exception of the program
    rc = _report(log, "[rank0]: Traceback (most recent call last):\n"
                      "[rank0]:   File \"/work/data/loader.py\", line 12, in get_path\n"
                      "[rank0]: ValueError: /tmp/data is not a valid directory.\n")["root_cause"]
    assert (rc["rule_id"], rc["category"]) == ("python.exception", "python_exception")


def test_a_launchers_bare_exit_code_after_the_timeouts_does_not_outrank_them(tmp_path):
    # a real CPU run under pdsh (two torchrun agents, gloo; benchmarks/inject_matrix.py seed 3103):
    # every rank timed out in all_reduce, then pdsh reported each node's exit code
    log = tmp_path / "pdsh.log"
    gloo = "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] " \
           "Timed out waiting 10000ms for recv operation to complete\n"
    rc = _report(log, "".join(f"worker-{r // 3}: [rank{r}]: {gloo}" for r in range(6))
                      + "pdsh@worker-0: worker-1: ssh exited with exit code 1\n"
                        "pdsh@worker-0: worker-0: ssh exited with exit code 1\n")["root_cause"]
    assert (rc["rule_id"], rc["category"]) == ("gloo.timeout", "collective_timeout")


def test_when_every_rank_timed_out_the_one_waiting_somewhere_else_is_named(tmp_path):
    # sample_logs/cpu/uneven_batches__np4: rank 1 ran out of batches and waits in barrier(); the
    # others wait in DDP's backward all-reduce, which has no c10d frame (its innermost frame is autograd's)
    log = tmp_path / "uneven.log"
    gloo = "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] " \
           "Timed out waiting 10000ms for recv operation to complete\n"

    def waiting_in(rank: int, where: str) -> str:
        frame = ('  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 5356, '
                 'in barrier\n    work.wait()\n' if where == "barrier" else
                 '  File "/venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 979, in '
                 '_engine_run_backward\n    return Variable._execution_engine.run_backward(\n')
        return "".join(f"[rank{rank}]: {line}\n" for line in
                       ("Traceback (most recent call last):", *frame.splitlines(), gloo.strip()))
    rc = _report(log, waiting_in(0, "backward") + waiting_in(2, "backward") + waiting_in(1, "barrier")
                 + waiting_in(3, "backward"))["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("gloo.timeout", 1)


def test_one_srun_task_terminated_before_any_other_ended_got_its_own_sigterm(tmp_path):
    # benchmarks/inject_matrix.py seed 3301 (rank_sigterm under srun --label tasks): task 4's
    # "Terminated" came first; srun's own teardown follows a failure (public54's lumi_ai_course_*)
    log = tmp_path / "srun_term.log"
    peer = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
            "Connection closed by peer [127.0.0.1]:17076.\n")
    rc = _report(log, "4: [rank 4] step 2 loss 0.2029\nsrun: error: node01: task 4: Terminated\n"
                      f"2: [rank2]: {peer}srun: error: node01: task 2: Exited with exit code 1\n")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("signal.sigterm_unsent", "crash_signal", 4)
    rc = _report(log, "0: [rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
                      "srun: error: node01: task 0: Exited with exit code 1\n"
                      "srun: error: node01: task 1: Terminated\n")["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("cuda.oom", 0)


def test_workers_that_died_of_the_same_signal_are_one_rank_set(tmp_path):
    # ROCm/ROCm#5788 (sample_logs/public38/rocm5788_*): the agent's `failed` line names one worker,
    # the summary's entries the others, each in its own words
    log = tmp_path / "segv.log"
    agent = "E1130 18:13:55.077000 21326 torch/distributed/elastic/multiprocessing/api.py:1002] "
    entry = ("[{i}]:\n  time      : 2026-11-30_18:13:55\n  host      : localhost\n  rank      : {r} (local_rank: {r})\n"
             "  exitcode  : -11 (pid: 2132{r})  (SIGSEGV)\n  error_file: <N/A>\n"
             "  traceback : Signal 11 (SIGSEGV) received by PID 2132{r}\n")
    rc = _report(log, f"{agent}failed (exitcode: -11) local_rank: 0 (pid: 21320) of binary: /venv/bin/python3\n"
                      + _summary(entry, (1, 2), 0))["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["ranks"]) == ("signal.sigsegv", 0, [0, 1, 2])


def test_with_only_exit_codes_the_summarys_first_observed_failure_is_the_rank(tmp_path):
    # hiyouga/ChatGLM-Efficient-Tuning#75 (sample_logs/public67/chatglmefficienttuning75_*): two
    # workers exited 1 in the same second; the summary lists rank 1 under Failures, rank 0 as root
    log = tmp_path / "exits.log"
    entry = ("[{i}]:\n  time      : 2023-06-05_17:57:46\n  host      : node-a\n  rank      : {r} (local_rank: {r})\n"
             "  exitcode  : 1 (pid: 3988{r})\n  error_file: <N/A>\n"
             "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n")
    rc = _report(log, _summary(entry, (1,), 0))["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["ranks"]) == ("signal.exit_nonzero", 0, [0, 1])


def test_an_unprefixed_exception_belongs_to_the_one_task_srun_saw_fail(tmp_path):
    # Lightning under srun (sample_logs/public69/quantumhydra_*): task 3 exited on its own, srun
    # terminated the others; with two tasks failing, srun's order of notices names no culprit
    log = tmp_path / "srun.log"
    error = "FileExistsError: [Errno 17] File exists:\n'/scratch/PhysioNet_EEG/MNE-eegbci-data/files/S043'\n\n"
    rc = _report(log, error + "srun: error: node: task 3: Exited with exit code 1\n"
                              "slurmstepd: error: *** STEP 45380617.0 ON node CANCELLED AT 2025-11-19T12:13:27 ***\n"
                              "srun: error: node: tasks 0-2: Terminated\n")["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["line"]) == ("python.exception", 3, 1)
    rc = _report(log, error + "srun: error: node-b: task 1: Exited with exit code 1\n"
                              "srun: error: node-a: task 0: Exited with exit code 1\n")["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("python.exception", None)


def test_an_unprefixed_kernel_assert_belongs_to_the_only_rank_in_the_excerpt(tmp_path):
    # ecmwf/WeatherGenerator (sample_logs/public70/weathergen255_*): the device's assert line, then
    # rank 104's traceback cut before its exception line
    log = tmp_path / "assert.log"
    assert_line = ("/opt/pytorch/pytorch/aten/src/ATen/native/cuda/ScatterGatherKernel.cu:144: operator(): block: "
                   "[7354,0,0], thread: [64,0,0] Assertion `idx_dim >= 0 && idx_dim < index_size && \"index out of "
                   "bounds\"` failed.\n")
    rank104 = ("[rank104]: Traceback (most recent call last):\n"
               '[rank104]:   File "/venv/bin/train_continue", line 10, in <module>\n'
               "[rank104]:     sys.exit(train_continue())\n")
    rc = _report(log, assert_line + rank104)["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["line"]) == ("cuda.device_side_assert", 104, 1)
    # a rank that only reports a peer's failure is a victim, not the owner
    victim = ("[rank3]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
              "peer [127.0.0.1]:5245\n")
    assert _report(log, assert_line + victim)["root_cause"]["rank"] is None


def test_one_exception_raised_at_the_same_place_on_two_ranks_is_one_bug(tmp_path):
    # transformers' from_pretrained on two pipeline stages (sample_logs/public70/distinference_*):
    # the same ValueError from the same function, each naming its own parameter
    log = tmp_path / "same_place.log"

    def rank_traceback(rank: int, param: str) -> str:
        return (f"[rank{rank}]: Traceback (most recent call last):\n"
                f'[rank{rank}]:   File "/venv/transformers/modeling_utils.py", line 918, in '
                f"_load_state_dict_into_meta_model\n"
                f'[rank{rank}]:     raise ValueError(f"{{param_name}} doesn\'t have any device set.")\n'
                f"[rank{rank}]: ValueError: {param} doesn't have any device set.\n")
    rc = _report(log, rank_traceback(1, "model.layers.0.self_attn.q_proj.weight")
                 + rank_traceback(0, "model.embed_tokens.weight"))["root_cause"]
    assert (rc["rule_id"], rc["ranks"], rc["exception_type"]) == ("python.exception", [0, 1], "ValueError")


def test_a_worker_pid_two_hosts_reused_is_read_from_its_own_agents_summary(tmp_path):
    # many agents in one log (benchmarks/generate.py with 8192 ranks on 1024 nodes; real hosts
    # reuse pids too): each agent's `failed` line is the worker its own summary lists next
    log = tmp_path / "nodes.log"
    agent = "E1130 00:24:48.250000 79257 torch/distributed/elastic/multiprocessing/api.py:869] "

    def node(host: str, rank: int, local: int, code: int) -> str:
        entry = (f"[{{i}}]:\n  time      : 2026-11-30_00:24:47\n  host      : {host}\n"
                 f"  rank      : {{r}} (local_rank: {local})\n  exitcode  : {code} (pid: 79299)\n  error_file: <N/A>\n"
                 "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n")
        return (f"{agent}failed (exitcode: {code}) local_rank: {local} (pid: 79299) of binary: /usr/bin/python3\n"
                + _summary(entry, (), rank))
    report = _report(log, node("node-275", 2201, 1, 1) + node("node-698", 5587, 3, 2))
    failed_lines = {f["line"]: f["rank"] for f in report["findings"] if f["text"].startswith("E1130")}
    assert sorted(failed_lines.values()) == [2201, 5587]
    assert failed_lines[min(failed_lines)] == 2201


def test_a_failure_torchrun_restarted_from_is_recovered_when_the_run_then_finishes(tmp_path):
    # a real CPU run (sample_logs/cpu_adhoc/restart_ok_np2_r1): rank 1's KeyError in attempt 0,
    # torchrun --max-restarts 1 restarts the workers, attempt 1 finishes; torchrun exited 0
    log = tmp_path / "restart.log"
    agent = "E1130 20:52:17.280000 1747 torch/distributed/elastic/multiprocessing/api.py:1002] "
    attempt0 = ("[rank 1] attempt 0 step 1 loss 8.0\n[rank1]: Traceback (most recent call last):\n"
                '[rank1]:   File "/tmp/job/fault4.py", line 11, in <module>\n[rank1]:     print(batch["labels"])\n'
                "[rank1]: KeyError: 'labels'\n"
                f"{agent}failed (exitcode: 1) local_rank: 1 (pid: 1771) of binary: /tmp/venv/bin/python3\n")
    attempt1 = "[rank 1] attempt 1 step 2 loss 8.0\n[rank 0] training finished\n[rank 1] training finished\n"
    report = _report(log, attempt0 + attempt1)
    assert (report["verdict"], report["root_cause"]) == ("ok", None)
    back = report["recovered"]
    assert (back["rule_id"], back["rank"], back["line"], back["exception_type"]) == ("python.exception", 1, 5, "KeyError")
    # the restart failed too: torchrun's summary ends the run, the KeyError is its root
    summary = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
               "============================================================\nfault4.py FAILED\n")
    report = _report(log, attempt0 + "[rank 1] attempt 1 step 0 loss 8.0\n" + summary)
    assert (report["verdict"], report["root_cause"]["rank"], report["recovered"]) == ("failed", 1, None)
    # no restart: a rank that finished its loop does not undo another rank's failure
    report = _report(log, attempt0.split(agent)[0] + "[rank 0] training finished\n")
    assert report["verdict"] == "failed"


def test_an_exception_python_ignored_at_exit_is_not_the_failure(tmp_path):
    # gaps round 14, row 38: CPython prints `Exception ignored in: <function ...__del__>` and the
    # traceback of a DataLoader iterator collected at exit, and the process goes on
    log = tmp_path / "ignored.log"
    ignored = ("Exception ignored in: <function _MultiProcessingDataLoaderIter.__del__ at 0x7f3c2a1b1e50>\n"
               "Traceback (most recent call last):\n"
               '  File "/venv/torch/utils/data/dataloader.py", line 1477, in __del__\n    self._shutdown_workers()\n'
               '  File "/usr/lib/python3.11/multiprocessing/process.py", line 160, in is_alive\n'
               "    assert self._parent_pid == os.getpid(), 'can only test a child process'\n"
               "AssertionError: can only test a child process\n")
    report = _report(log, "[rank 0] step 10 loss 0.5\n[rank 0] training finished\n" + ignored)
    assert (report["verdict"], report["root_cause"]) == ("ok", None)
    oom = ("[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total "
           "capacity of 79.15 GiB of which 1.20 GiB is free.\n")
    rc = _report(log, oom + ignored)["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["line"]) == ("cuda.oom", 1, 1)


def test_one_pytest_report_line_with_an_exception_is_read(tmp_path):
    # NVIDIA/Megatron-LM's CI (sample_logs/public74/megatronlm5025_*): pytest's `E` marker on the
    # one line that holds the exception
    log = tmp_path / "pytest.log"
    rc = _report(log, "tests/unit_tests/transformer/moe/test_aux_loss.py::TestRouterAuxLoss::test_fusion FAILED\n\n"
                      "E       RuntimeError: /te/common/fused_router/fused_moe_aux_loss.cu:90 in function "
                      "fused_moe_aux_loss_forward_kernel_launcher: Assertion failed: num_experts == num_cols.\n")["root_cause"]
    assert (rc["rule_id"], rc["exception_type"], rc["line"]) == ("python.exception", "RuntimeError", 3)


def test_a_worker_the_older_test_harness_names_owns_the_unprefixed_error(tmp_path):
    # pytorch/pytorch#40266 (sample_logs/public74/pytorch40266_*): MultiProcessTestCase names the
    # process (its rank) that exited first
    log = tmp_path / "harness.log"
    rc = _report(log, "RuntimeError: CUDA error: out of memory\nexiting process with exit code: 10\n"
                      "Process 2 terminated with exit code 10, terminating remaining processes.\n")["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["line"]) == ("cuda.oom", 2, 1)


def test_the_test_harness_header_names_the_rank_of_the_traceback_under_it(tmp_path):
    # intel/torch-xpu-ops#3376 (sample_logs/public76/torchxpuops3376_*): MultiProcessTestCase's
    # `Process 1 exited with error code 10 and exception:`, then the child's own traceback
    log = tmp_path / "harness.log"
    rc = _report(log, "Process 1 exited with error code 10 and exception:\nTraceback (most recent call last):\n"
                      '  File "/ws/test/distributed/test_c10d_xccl.py", line 5390, in _verify_trace\n'
                      "    torch_comm_lib_version = torch.xpu.xccl.version()\n"
                      "AttributeError: module 'torch.xpu' has no attribute 'xccl'\n")["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["exception_type"]) == ("python.exception", 1, "AttributeError")


def test_slurmstepd_under_srun_label_is_not_the_labelled_tasks_line(tmp_path):
    # a Perlmutter run's notes (sample_logs/public75/perlmutter_*): srun -l puts the step daemon's
    # OOM-kill notice under task 0's label; srun's own line names task 2
    log = tmp_path / "srun.log"
    rc = _report(log, "0: iteration 1 | loss 11.2\n"
                      "0: slurmstepd: error: Detected 1 oom_kill event in StepId=17109804.0. Some of the step tasks "
                      "have been OOM Killed.\nsrun: error: node: task 2: Out Of Memory\n"
                      "srun: Terminating StepId=17109804.0\n")["root_cause"]
    assert (rc["category"], rc["rank"]) == ("host_oom", 2)


def test_c10d_resolution_warning_is_no_failure_unless_the_output_stops_on_it(tmp_path):
    # c10d's socket.cpp warning as printed by torch 2.x (sample_logs/public24/grendelgs9_*,
    # public17/torchx540_*): it retries, so alone in a run that goes on it is no failure; a run
    # that stops on it hangs there; a later error stays the root
    log = tmp_path / "gai.log"
    warning = ("[W1130 01:05:55.120000000 socket.cpp:753] [c10d] The IPv6 network addresses of (node-01, 29500) "
               "cannot be retrieved (gai error: -2 - Name or service not known).\n")
    finished = _report(log, warning + "[rank0]: step 1 loss 0.3\n[rank0]: step 2 loss 0.2\ntraining finished\n")
    assert (finished["verdict"], finished["root_cause"]) == ("ok", None)
    stuck = _report(log, "[rank0]: world_size=2\n" + warning)
    assert (stuck["verdict"], stuck["root_cause"]["rule_id"], stuck["root_cause"]["line"]) == (
        "hung", "dist.name_resolution", 2)
    later = _report(log, warning + "[rank1]: Traceback (most recent call last):\n"
                         '[rank1]:   File "/ws/train.py", line 9, in <module>\n[rank1]:     batch["target"]\n'
                         "[rank1]: KeyError: 'target'\n")["root_cause"]
    assert (later["category"], later["rank"], later["exception_type"]) == ("python_exception", 1, "KeyError")
    # the same text at ERROR level, or printed by Python, fails the run
    error = _report(log, "socket.gaierror: [Errno -2] Name or service not known\n")["root_cause"]
    assert error["rule_id"] == "dist.name_resolution"


def test_several_ranks_exception_names_glued_are_one_type(tmp_path):
    # sample_logs/public78/moe_autotp_*: four ranks wrote their exception lines at once
    log = tmp_path / "glued.log"
    rc = _report(log, _traceback("/root/fix.py", 47, "<module>", "gen_tokens = model.generate(",
                                 "TypeErrorTypeErrorTypeError: : TypeError: generate() argument after ** must be a "
                                 "mapping, not Tensorgenerate() argument after ** must be a mapping, not Tensor"))["root_cause"]
    assert (rc["rule_id"], rc["exception_type"]) == ("python.exception", "TypeError")


def test_a_time_limit_around_a_stuck_test_is_a_hang(tmp_path):
    # pytorch/pytorch#29382 (sample_logs/public76/pytorch29382_*): MultiProcessTestCase ends a
    # process still running at the test's timeout; the run was stuck, the limit only ended it
    log = tmp_path / "harness.log"
    report = _report(log, "Process 0 terminated or timed out after 300.0 seconds\n")
    assert (report["verdict"], report["root_cause"]["rule_id"]) == ("hung", "hang.test_harness_timeout")


def test_vllms_own_workers_share_the_node_so_the_oom_device_is_the_rank_but_rays_are_not(tmp_path):
    # sample_logs/public82/nim_*: vLLM's multiprocessing executor, TP 2; the worker on cuda:0 fails its
    # start-up memory check. Under Ray every worker sees its own GPU as cuda:0, which names no rank.
    text = ("({who} pid=428) ERROR 09-01 07:40:16 [multiproc_executor.py:901] ValueError: Free memory on device "
            "cuda:{dev} (110.9/140.55 GiB) on startup is less than desired GPU memory utilization (0.8, 112.44 GiB). "
            "Decrease GPU memory utilization or reduce GPU memory used by other processes.\n")
    log = tmp_path / "v.log"
    rc = _report(log, text.format(who="Worker", dev=1))["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["rank"]) == ("gpu_oom", "cuda.oom", 1)
    rc = _report(log, text.format(who="RayWorkerWrapper", dev=0))["root_cause"]
    assert (rc["category"], rc["rank"]) == ("gpu_oom", None)


def test_an_exception_type_is_read_from_an_error_files_message_and_from_a_code_named_error(tmp_path):
    # learnables/learn2learn#263 (sample_logs/public34/learn2learn263_*): torchelastic's error
    # handler logs the error file, its type inside the "message" field
    log = tmp_path / "json.log"
    rc = _report(log, "ERROR:torch.distributed.elastic.multiprocessing.errors.error_handler:{\n"
                      '  "message": {\n'
                      '    "message": "RuntimeError: Address already in use",\n')["root_cause"]
    assert (rc["rule_id"], rc["exception_type"]) == ("dist.port_in_use", "RuntimeError")
    # facebookresearch/lingua (sample_logs/public75/lingua_errors_zoo_*): pynvml names its
    # errors by code, `NVMLError_NotSupported`
    log = tmp_path / "nvml.log"
    rc = _report(log, _traceback("/usr/lib/python3/site-packages/torch/cuda/__init__.py", 1087, "power_draw",
                                 "return pynvml.nvmlDeviceGetPowerUsage(handle)",
                                 "pynvml.nvml.NVMLError_NotSupported: Not Supported"))["root_cause"]
    assert (rc["rule_id"], rc["exception_type"]) == ("cuda.nvml_failure", "pynvml.nvml.NVMLError_NotSupported")


def test_rays_report_of_an_actor_that_died_in_its_creation_task_yields_to_the_error_it_carries(tmp_path):
    # gptbert/ai-agent-book-projects (sample_logs/public95/cursor_chat_verl_retool_*): the driver's
    # ActorDiedError prints the actor's own traceback under it, ending in the real error
    log = tmp_path / "ray.log"
    rc = _report(log, _traceback("/root/verl/verl/experimental/agent_loop/agent_loop.py", 846, "generate_sequences",
                                 "outputs = ray.get(",
                                 "ray.exceptions.ActorDiedError: The actor died because of an error raised in its "
                                 "creation task, ray::agent_loop_worker_0:AgentLoopWorker.__init__() (pid=716404)",
                                 '  File "/root/verl/verl/utils/rollout_trace.py", line 69, in init',
                                 "    import weave",
                                 "ModuleNotFoundError: No module named 'weave'"))["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["line"], rc["exception_type"]) == (
        "python.module_not_found", "environment", 7, "ModuleNotFoundError")


def test_a_bootstrap_root_mismatch_at_one_world_size_is_another_nccl_build_and_at_two_a_launch_mistake(tmp_path):
    # devopsrustem/slurmv4 (sample_logs/public98/slurmv4_sglang_pd_decode_2node_*): two nodes on
    # different NCCL builds; the same NCCL on both fixed it
    failed = "RuntimeError: NCCL error: remote process exited or there was a network error\n"
    log = tmp_path / "layout.log"
    rc = _report(log, "node03:2399196:2400932 [0] bootstrap.cc:345 NCCL WARN Bootstrap Root : mismatch in info "
                      "from procs, nranks 16 vs 16, nroots 1 vs 1, iroot 0 vs 0, offset -340262910 vs 0\n"
                 + failed)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["line"]) == ("nccl.version_mismatch", "environment", 1)
    log = tmp_path / "world.log"
    rc = _report(log, "node01:4200:4290 [0] bootstrap.cc:335 NCCL WARN Bootstrap Root : mismatch in info from "
                      "procs, nranks 4 vs 8, nroots 1 vs 1, iroot 0 vs 0, offset 0 vs 0\n" + failed)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["line"]) == ("nccl.invalid_rank", "launch_usage", 1)


def test_a_missing_module_attribute_looked_up_by_an_installed_package_is_a_version_mismatch(tmp_path):
    # sample_logs/public92/segr1_* (flash-attn calling torch.library.wrap_triton under torch 2.5);
    # the same AttributeError in the job's own code stays a Python exception
    missing = "AttributeError: module 'torch.library' has no attribute 'wrap_triton'"
    log = tmp_path / "package.log"
    rc = _report(log, _traceback("/envs/seg/lib/python3.11/site-packages/flash_attn/ops/triton/rotary.py", 159,
                                 "apply_rotary", "@torch.library.wrap_triton", missing))["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["exception_type"]) == (
        "env.package_api_missing", "environment", "AttributeError")
    log = tmp_path / "own.log"
    rc = _report(log, _traceback("/workspace/train.py", 12, "main", "@torch.library.wrap_triton", missing))["root_cause"]
    assert (rc["rule_id"], rc["category"]) == ("python.exception", "python_exception")
    log = tmp_path / "itself.log"
    rc = _report(log, _traceback("/usr/lib/python3/site-packages/torch/_ops.py", 12, "lookup",
                                 "torch.library.wrap_triton", missing))["root_cause"]
    assert (rc["rule_id"], rc["category"]) == ("python.exception", "python_exception")


_CLOSED_BY_PEER = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                   "peer [127.0.0.1]:58542. This is typically caused by a remote worker crashing.\n")
_EXIT1_ENTRY = "[{i}]:\n  rank      : {r} (local_rank: {r})\n  exitcode  : 1 (pid: 10{r})\n  error_file: <N/A>\n"


def _gloo_timeout(rank: int) -> str:
    return (f"[rank{rank}]: Traceback (most recent call last):\n"
            f'[rank{rank}]:   File "/tmp/job/train.py", line 77, in main\n'
            f"[rank{rank}]:     loss.backward()\n"
            f"[rank{rank}]: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] "
            "Timed out waiting 15000ms for send operation to complete\n")


def test_an_unprefixed_error_belongs_to_the_rank_the_others_timeouts_wait_for(tmp_path):
    # sample_logs/cpu_adhoc/thread_exception_np4_r2_loglevel: a KeyError in a thread of rank 2,
    # printed without its prefix; ranks 0, 1 and 3 time out in DDP's all-reduce
    log = tmp_path / "thread.log"
    rc = _report(log, "".join(f"[rank{r}]: step 1 loss 0.3\n" for r in range(4))
                 + "Exception in thread prefetch:\n"
                 + _traceback("/tmp/job/train.py", 55, "prefetch", "box.append(shard['input_ids'])",
                              "KeyError: 'input_ids'")
                 + "".join(_gloo_timeout(r) for r in (3, 1, 0)))["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["exception_type"]) == ("python.exception", 2, "KeyError")


def test_a_clean_exit_that_leaves_several_ranks_waiting_is_the_rank_that_stopped_early(tmp_path):
    # sample_logs/cpu_adhoc/early_return_np4_r3: rank 3 returns from main() (exit 0); the three
    # others lose their peer in the all-reduce
    log = tmp_path / "early.log"
    rc = _report(log, "".join(f"[rank{r}]: step 2 loss 0.3\n" for r in range(4))
                 + "".join(f"[rank{r}]: Traceback (most recent call last):\n[rank{r}]: " + _CLOSED_BY_PEER
                           for r in (0, 2, 1))
                 + _summary(_EXIT1_ENTRY, (1, 2), 0))["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("gloo.connection_closed", "collective_error", 3)


def test_a_destroyed_process_group_on_a_rank_that_trained_is_a_program_bug_not_a_missing_init(tmp_path):
    # sample_logs/cpu_adhoc/destroy_early_np4_r2_role
    missing = "ValueError: Default process group has not been initialized, please make sure to call init_process_group."
    log = tmp_path / "destroyed.log"
    rc = _report(log, "".join(f"[rank{r}]: rank {r} step 4 loss 0.3\n" for r in range(3))
                 + f"[rank2]: Traceback (most recent call last):\n[rank2]: {missing}\n")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("python.exception", "python_exception", 2)
    log = tmp_path / "never.log"
    rc = _report(log, f"[rank2]: Traceback (most recent call last):\n[rank2]: {missing}\n")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("dist.pg_not_initialized", "launch_usage", 2)


def test_a_worker_sigkill_sent_by_torchelastics_timer_is_a_hang_not_the_oom_killer(tmp_path):
    # torch/distributed/elastic/timer/file_based_local_timer.py logs the reaping at INFO level
    log = tmp_path / "timer.log"
    rc = _report(log, "[rank1]: step 1 loss 0.3\n[rank0]: step 1 loss 0.3\n"
                      "I1201 10:00:00.000000 1234 torch/distributed/elastic/timer/file_based_local_timer.py:321] "
                      "Reaping worker_pid=[1235]. Expired timers: ['train_step']\n"
                      "E1201 10:00:01.100000 1233 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
                      "(exitcode: -9) local_rank: 1 (pid: 1235) of binary: /usr/bin/python\n")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("hang.elastic_timer_expired", "hang", 1, 3)


def test_a_store_connect_that_timed_out_on_a_host_c10d_could_not_resolve_is_name_resolution(tmp_path):
    # sample_logs/cpu_adhoc/bad_host_np4_r3_runmodule: c10d warns and retries, then times out
    host = "trainer-master-0.cluster.internal"
    log = tmp_path / "host.log"
    rc = _report(log, f"[rank3]:[W1201 09:27:16.390007199 socket.cpp:764] [c10d] The IPv6 network addresses of "
                      f"({host}, 29631) cannot be retrieved (gai error: -2 - Name or service not known).\n"
                      f"[rank3]:[E1201 09:27:29.450014075 socket.cpp:1028] [c10d] The client socket has timed out "
                      f"after 15000ms while trying to connect to ({host}, 29631).\n")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("dist.name_resolution", "rendezvous", 3)


def test_silent_ranks_that_exited_with_their_own_error_are_not_missing_from_the_collective(tmp_path):
    # sample_logs/cpu_adhoc/recv_never_np5_r4_filter: --local-ranks-filter 0,4 hides ranks 1-3;
    # the summary says ranks 1 and 2 exited 1, so their silence is the filter, not absence
    body = ("".join(f"rank {r} step 2 loss 0.3\n" for r in (4, 0))
            + "[rank0]: Traceback (most recent call last):\n[rank0]: " + _CLOSED_BY_PEER + _gloo_timeout(4))
    log = tmp_path / "filtered.log"
    rc = _report(log, body + _summary(_EXIT1_ENTRY, (1, 2, 4), 0))["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("gloo.timeout", "collective_timeout", 4)
    # without the summary's word that they failed on their own, silent ranks stay the missing ones
    log = tmp_path / "absent.log"
    rc = _report(log, "".join(f"[rank{r}]: step 2 loss 0.3\n" for r in (0, 1, 2))
                 + "".join(_gloo_timeout(r) for r in (0, 1, 2))
                 + _summary(_EXIT1_ENTRY.replace("exitcode  : 1", "exitcode  : -15"), (3,), 0))["root_cause"]
    assert (rc["category"], rc["rank"]) == ("collective_timeout", 3)


def test_a_cuda_oom_on_a_gpu_that_the_jobs_own_ranks_fill_is_a_device_assignment(tmp_path):
    # sample_logs/public105/voyager17_*: every rank's pipeline offloads to cuda:0; the OOM lists
    # four neighbouring PIDs holding GiBs. Stray contexts of a few hundred MiB stay the OOM.
    oom = ("[rank2]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 72.00 MiB. GPU 0 has a total "
           "capacity of 47.53 GiB of which 46.69 MiB is free. {procs}Of the allocated memory 1.55 GiB is "
           "allocated by PyTorch\n")
    held = "".join(f"Process 30553{p} has {m} memory in use. " for p, m in ((7, "1.81 GiB"), (6, "2.76 GiB"),
                                                                          (8, "1.95 GiB"), (5, "40.95 GiB")))
    ranks = "".join(f"[rank{r}]: step 0 loading\n" for r in range(4))
    log = tmp_path / "shared.log"
    rc = _report(log, ranks + oom.format(procs=held))["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("cuda.ranks_share_gpu", "device_assignment", 2)
    contexts = "".join(f"Process 1830{p} has 540.00 MiB memory in use. " for p in range(4))
    rc = _report(log, ranks + oom.format(procs="Including non-PyTorch memory, this process has 45.45 GiB memory "
                                               "in use. " + contexts))["root_cause"]
    assert (rc["rule_id"], rc["category"]) == ("cuda.oom", "gpu_oom")


def test_a_torchrun_stop_after_slurm_reported_a_failed_task_is_teardown_and_the_task_the_cause(tmp_path):
    # docs/research/gaps20.md row 12: another node's task exited 1; Slurm ends the step, torchrun
    # here gets SIGTERM
    progress = "".join(f"[rank{r}]:step 20 loss 2.1\n" for r in (0, 1))
    stop = ("W1201 10:00:05.000000 1234 torch/distributed/elastic/agent/server/api.py:753] Received "
            "Signals.SIGTERM death signal, shutting down workers\n"
            "torch.distributed.elastic.multiprocessing.api.SignalException: Process 1234 got signal: 15\n")
    log = tmp_path / "step.log"
    rc = _report(log, progress + "srun: error: node02: task 1: Exited with exit code 1\n"
                 "slurmstepd: error: *** STEP 881234.0 ON node01 FAILED (non-zero exit code or other failure mode) ***\n"
                 + stop)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("sched.srun_task_exit", "unknown", 1)
    rc = _report(log, progress + stop)["root_cause"]
    assert (rc["rule_id"], rc["category"]) == ("launcher.signal_exception", "external_stop")


def test_a_worker_sigkill_the_scheduler_says_it_sent_is_its_stop_not_the_oom_killer(tmp_path):
    killed = ("E1201 10:00:05.000000 1234 torch/distributed/elastic/multiprocessing/api.py:882] failed "
              "(exitcode: -9) local_rank: 1 (pid: 1236) of binary: /usr/bin/python\n")
    log = tmp_path / "kill.log"
    rc = _report(log, "[rank1]:step 20 loss 2.1\nslurmstepd: error: *** STEP 881234.0 ON node01 CANCELLED AT "
                      "2026-11-30T22:14:05 DUE to SIGNAL Killed ***\n" + killed)["root_cause"]
    assert (rc["rule_id"], rc["category"]) == ("sched.slurm_cancelled", "external_stop")
    rc = _report(log, "[rank1]:step 20 loss 2.1\n" + killed)["root_cause"]
    # (no sign of a GPU in the log: a kill of either kind, stop 63)
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("signal.sigkill", "crash_signal", 1)


def test_a_vllm_workers_exception_behind_its_logger_header_is_read_with_its_type(tmp_path):
    # docs/research/gaps23.md rows 41, 44: vLLM logs each traceback line of a worker as a record
    head = "(VllmWorker rank=1 pid=1235) ERROR 12-01 10:00:00 [multiproc_executor.py:487] "
    log = tmp_path / "vllm.log"
    rc = _report(log, "".join(head + t + "\n" for t in (
        "Traceback (most recent call last):", '  File "/usr/lib/vllm/worker.py", line 113, in init_device',
        "    self.model_runner.load_model()",
        "NotImplementedError: Pipeline parallelism is not supported for this model.")))["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["exception_type"]) == ("python.exception", 1, "NotImplementedError")


def test_ray_trains_run_report_yields_to_the_workers_own_error_under_it(tmp_path):
    # docs/research/gaps23.md row 23: WorkerGroupError carries rank 1's OOM in an error snippet
    log = tmp_path / "ray.log"
    rc = _report(log, _traceback("/workspace/serve.py", 42, "<module>", "main()",
                                 "ray.train.v2.api.exceptions.WorkerGroupError: Training failed due to worker errors:",
                                 "[Rank 1 Error Snippet]:")
                 + _traceback("/workspace/train.py", 42, "train_func", "loss.backward()",
                              "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a "
                              "total capacity of 79.15 GiB of which 1.02 GiB is free."))["root_cause"]
    assert (rc["rule_id"], rc["category"]) == ("cuda.oom", "gpu_oom")


def test_terabytes_asked_for_inside_an_object_collective_are_a_mismatch_not_host_memory(tmp_path):
    # sample_logs/cpu_adhoc/bol_len_*: one rank's broadcast_object_list had a longer list, so it read
    # a size out of the others' pickled bytes; a plausible size there stays host memory
    frames = ('[rank3]: Traceback (most recent call last):\n'
              '[rank3]:   File "/tmp/job/train.py", line 61, in step\n'
              '[rank3]:     dist.broadcast_object_list(objs, src=0)\n'
              '[rank3]:   File "/tmp/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", '
              'line 4039, in {func}\n'
              '[rank3]: RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: '
              "can't allocate memory: you tried to allocate {size} bytes. Error code 12 (Cannot allocate memory)\n")
    log = tmp_path / "b.log"
    rc = _report(log, frames.format(func="broadcast_object_list", size=140027976474774))["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["rank"]) == ("collective_mismatch", "dist.collective_mismatch", 3)
    for func, size in (("broadcast_object_list", 34359738368), ("all_reduce", 140027976474774)):
        rc = _report(log, frames.format(func=func, size=size))["root_cause"]
        assert (rc["category"], rc["rule_id"]) == ("host_oom", "host.cpu_alloc")


def test_the_pin_memory_threads_re_raise_yields_to_its_original_error(tmp_path):
    # torch/_utils.py ExceptionWrapper, where="in pin memory thread for device 0" (gaps31 row 34)
    log = tmp_path / "pin.log"
    rc = _report(log, "[rank1]: Traceback (most recent call last):\n"
                      '[rank1]:   File "/env/torch/_utils.py", line 794, in reraise\n'
                      "[rank1]:     raise exception\n"
                      "[rank1]: RuntimeError: Caught RuntimeError in pin memory thread for device 0.\n"
                      "[rank1]: Original Traceback (most recent call last):\n"
                      '[rank1]:   File "/env/torch/utils/data/_utils/pin_memory.py", line 79, in pin_memory\n'
                      "[rank1]:     return data.pin_memory(device)\n"
                      "[rank1]: TypeError: cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned\n"
                 )["root_cause"]
    assert (rc["exception_type"], rc["rank"], rc["line"]) == ("TypeError", 1, 8)


def test_a_threads_error_as_the_interpreter_shuts_down_is_not_the_runs_failure(tmp_path):
    # wandb's system monitor submitting work at exit (gaps31 row 64): a finished run stays ok
    thread = ("[rank1]: Exception in thread Thread-2 (_monitor):\n[rank1]: Traceback (most recent call last):\n"
              '[rank1]:   File "/env/wandb/sdk/internal/system/assets/interfaces.py", line 168, in _monitor\n'
              "[rank1]:     self._pool.submit(self.sample)\n"
              "[rank1]: RuntimeError: cannot schedule new futures after interpreter shutdown\n")
    log = tmp_path / "t.log"
    report = _report(log, "[rank0]: step 200 loss 2.1\n[rank0]: training finished\n" + thread
                     + "I1201 10:05:00.000000 1234 torch/distributed/elastic/agent/server/api.py:879] [default] "
                       "worker group successfully finished. Waiting 300 seconds for other agents to finish.\n")
    assert (report["verdict"], report["root_cause"]) == ("ok", None)


def test_one_rank_alone_in_a_collective_while_all_others_are_elsewhere_took_the_other_path(tmp_path):
    # sample_logs/cpu_adhoc/new_group_partial_*: rank 2 skipped a new_group the others entered, went
    # on to DDP's all-reduce and timed out there alone; the three others were SIGTERMed in new_group
    steps = "".join(f"[rank{r}]: rank {r} step 2 loss 1.0\n" for r in range(4))
    timeout = ("[rank{r}]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
               "Timed out waiting 15000ms for recv operation to complete\n")
    log = tmp_path / "g.log"
    rc = _report(log, steps + timeout.format(r=2))["root_cause"]
    assert (rc["category"], rc["rank"], rc["ranks"]) == ("collective_timeout", 2, [2])
    # two waiting ranks and two elsewhere: no lone rank; rank 0, among the absent, as before
    rc = _report(log, steps + timeout.format(r=2) + timeout.format(r=3))["root_cause"]
    assert (rc["rank"], rc["ranks"]) == (0, [0, 1])


def test_storage_errors_of_any_type_inside_a_checkpoint_frame_are_the_checkpoints(tmp_path):
    # docs/research/gaps34.md rows 9 and 58: torch 1.x's RuntimeError for EIO inside a save
    # (pytorch/pytorch#10577), an object store's 404 for the checkpoint a resume loads
    frames = ('[rank1]: Traceback (most recent call last):\n'
              '[rank1]:   File "/workspace/train.py", line 88, in {func}\n'
              '[rank1]:     {code}\n'
              "[rank1]: {error}\n")
    log = tmp_path / "s.log"
    rc = _report(log, frames.format(func="save_checkpoint", code="torch.save(state, path)",
                                    error="RuntimeError: write(): fd 29 failed with Input/output error"))["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["rank"]) == ("checkpoint", "ckpt.io_error", 1)
    missing = ("botocore.exceptions.ClientError: An error occurred (404) when calling the HeadObject operation: "
               "Not Found")
    rc = _report(log, frames.format(func="load_checkpoint", code="s3.download_file(bucket, key, local)",
                                    error=missing))["root_cause"]
    assert (rc["category"], rc["rule_id"]) == ("checkpoint", "ckpt.not_found")
    # the store refusing the credentials is the environment's, wherever it happens
    refused = ("botocore.exceptions.ClientError: An error occurred (AccessDenied) when calling the PutObject "
               "operation: Access Denied")
    rc = _report(log, frames.format(func="save_checkpoint", code="s3.upload_file(local, bucket, key)",
                                    error=refused))["root_cause"]
    assert (rc["category"], rc["rule_id"]) == ("environment", "env.object_store")
    rc = _report(log, frames.format(func="build_dataset", code="lmdb.open(path)",
                                    error="lmdb.Error: /data/train_lmdb: No such file or directory"))["root_cause"]
    assert (rc["category"], rc["exception_type"]) == ("python_exception", "lmdb.Error")


def test_a_traceback_the_logging_module_printed_and_went_on_from_is_not_the_root(tmp_path):
    # Python's logging Handler.handleError: `--- Logging error ---`, the traceback, the call stack,
    # then the program carries on (here to a KeyError that ends the rank)
    log = tmp_path / "l.log"
    rc = _report(log, "".join("[rank1]: " + line + "\n" for line in (
        "--- Logging error ---", "Traceback (most recent call last):",
        '  File "/usr/lib/python3.10/logging/__init__.py", line 1084, in flush', "    self.stream.flush()",
        "OSError: [Errno 28] No space left on device", "Call stack:",
        '  File "/workspace/train.py", line 75, in main', '    logger.info("step %d", step)',
        "Message: 'step %d'", "Arguments: (101,)", "Traceback (most recent call last):",
        '  File "/workspace/train.py", line 77, in main', '    y = batch["target"]', "KeyError: 'target'")))["root_cause"]
    assert (rc["rule_id"], rc["exception_type"], rc["rank"], rc["line"]) == ("python.exception", "KeyError", 1, 14)


def test_a_worker_the_launcher_killed_after_its_sigterm_failed_is_teardown_not_a_crash(tmp_path):
    # sample_logs/cpu_adhoc/sigstop_np3_r2_tee: rank 2 stopped itself (SIGSTOP); ranks 0 and 1 timed
    # out waiting for it; torchrun's SIGTERM could not end it, so torchrun sent SIGKILL (exit -9)
    agent = "W1201 23:17:{s}.304000 2092 torch/distributed/elastic/multiprocessing/api.py:{n}] "
    timeout = ("[rank{r}]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
               "Timed out waiting 15000ms for recv operation to complete\n")
    log = tmp_path / "k.log"
    text = ("".join(f"[rank{r}]: rank {r} step 2\n" for r in range(3)) + timeout.format(r=1) + timeout.format(r=0)
            + agent.format(s=27, n=1028) + "Sending process 2132 closing signal SIGTERM\n"
            + agent.format(s=57, n=1047) + "Unable to shutdown process 2132 via 15, forcefully exiting via 9\n"
            + "E1201 23:17:57.565000 2092 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) "
              "local_rank: 2 (pid: 2132) of binary: /tmp/venv/bin/python3\n")
    rc = _report(log, text)["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["rank"]) == ("collective_timeout", "gloo.timeout", 2)
    # without the launcher's own SIGKILL the -9 stays the worker's end (a CPU job: not the OOM killer)
    rc = _report(log, text.replace("Unable to shutdown process 2132 via 15, forcefully exiting via 9",
                                   "worker group stopped"))["root_cause"]
    assert (rc["category"], rc["rule_id"], rc["rank"]) == ("crash_signal", "signal.sigkill", 2)


def test_a_second_nodes_lost_rendezvous_pasted_first_yields_to_a_workers_error(tmp_path):
    # two nodes' consoles pasted one after the other, node 1's first: its agent lost the store when
    # node 0's agent exited after rank 1's MemoryError (docs/research/gaps43.md S1; the agent's lines
    # of cpu_adhoc huge_alloc_np6_r1_pdsh2, torch 2.13)
    node1 = ("W1202 04:58:08.402000 12984 torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:1298] The node "
             "'localhost_12984_0' has failed to shutdown the rendezvous 'none' due to an error of type "
             "RendezvousConnectionError.\n"
             + _traceback("/venv/torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py", 116, "_call_store",
                          "raise RendezvousConnectionError(",
                          "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the "
                          "C10d store has failed. See inner exception for details."))
    node0 = "".join(f"[rank1]:{line}\n" for line in _traceback(
        "/job/train.py", 88, "main", "buf = bytearray(16 << 40)", "MemoryError").splitlines())
    rc = _report(tmp_path / "run.log", "node 1:\n" + node1 + "\nnode 0:\n" + node0)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("host.memory_error", "host_oom", 1)
    # alone, the lost rendezvous is still what the log shows
    rc = _report(tmp_path / "run.log", node1)["root_cause"]
    assert (rc["rule_id"], rc["category"]) == ("dist.rendezvous_connection", "rendezvous")


def _node_consoles(path: str) -> list[list[str]]:
    """A real two-node run's console split by its srun (`1: `) or pdsh (`worker-1: `) label into
    each node's own console, label stripped, each node's order kept (as one node's terminal shows it)."""
    nodes: list[list[str]] = [[], []]
    for line in open(path, encoding="utf-8").read().splitlines():
        m = re.match(r"^(?:worker-)?([01]): ", line)
        if m:
            nodes[int(m.group(1))].append(line[m.end():])
    return nodes


def test_tee_local_ranks_of_a_nodes_console_pasted_without_host_labels_are_its_global_ranks(tmp_path):
    # sample_logs/cpu_adhoc/sigbus_np8_r6_srun2 (torch 2.13, two torchrun agents under srun, --tee 3):
    # rank 6 (node 1's local rank 2) died of SIGBUS, printing no traceback, only `[default2]:` lines.
    # Pasted node by node without srun's labels, or node 1's console alone, `[default2]:` is rank 6
    # there (its summary's `rank : 6 (local_rank: 2)`, its `[default3]:[rank7]:` lines) and rank 2 in
    # node 0's console.
    node0, node1 = _node_consoles("sample_logs/cpu_adhoc/sigbus_np8_r6_srun2.log")
    log = tmp_path / "paste.log"
    for lines in (node0 + node1, node1 + node0, node1, ["node 0:"] + node0 + ["", "node 1:"] + node1):
        report = _report(log, "\n".join(lines) + "\n")
        rc = report["root_cause"]
        assert (rc["rule_id"], rc["category"], rc["rank"]) == ("signal.sigbus", "crash_signal", 6)
        assert "Fatal Python error: Bus error" in rc["text"]
        speaking = {r["rank"] for r in report["ranks"] if r["lines"]}
        assert speaking >= {4, 5, 6, 7} and (lines is node1 or speaking >= {0, 1, 2, 3})
    # two files, one per node, named for the node (not a rank's file: `worker-1.log` holds node 1's
    # console, its agent's lines and four ranks'), given one by one or as their folder: each is a
    # console of its own
    folder = tmp_path / "nodes"
    folder.mkdir()
    (folder / "worker-0.log").write_text("\n".join(node0) + "\n")
    (folder / "worker-1.log").write_text("\n".join(node1) + "\n")
    for args in ([str(folder / "worker-1.log"), str(folder / "worker-0.log")], [str(folder)]):
        rc = triage(args).to_dict()["root_cause"]
        assert (rc["rule_id"], rc["rank"]) == ("signal.sigbus", 6)


def test_two_nodes_lines_interleaved_in_one_console_map_only_the_local_ranks_they_agree_on(tmp_path):
    # the same run, srun's labels removed but the nodes' lines left interleaved (as a collector merges
    # them). Node 1's summary, printed first, ends a console: before it `[default3]:` is rank 7 in node 1's
    # tracebacks and rank 3 in node 0's, so it maps to neither and stays 3 (rank 7's lines stay its own);
    # `[default2]:` pairs with node 1's summary entry alone (rank 6), so the SIGBUS line before it is rank
    # 6's. (The scope is only as good as the order: node 0's `[default1]:` lines there read as rank 5.)
    lines = [re.sub(r"^[01]: ", "", line) for line in
             open("sample_logs/cpu_adhoc/sigbus_np8_r6_srun2.log", encoding="utf-8").read().splitlines()]
    report = _report(tmp_path / "merged.log", "\n".join(lines) + "\n")
    rc = report["root_cause"]
    assert (rc["rule_id"], rc["rank"], lines[rc["line"] - 1]) == (
        "signal.sigbus", 6, "[default2]:Fatal Python error: Bus error")
    speaking = {r["rank"] for r in report["ranks"] if r["lines"]}
    assert {3, 7} <= speaking


def test_ranks_of_a_node_whose_console_is_not_pasted_did_not_skip_the_collective(tmp_path):
    # sample_logs/cpu_adhoc/stall_np6_r3_pdsh2 (two agents of three ranks under pdsh): rank 3 (node 1's
    # local rank 0) stalled, ranks 4 and 5 timed out. Node 1's console alone: ranks 0-2 print nothing
    # and its agent's summary does not list them; they are the other node's, not the ranks that
    # never joined
    node0, node1 = _node_consoles("sample_logs/cpu_adhoc/stall_np6_r3_pdsh2.log")
    rc = _report(tmp_path / "node1.log", "\n".join(node1) + "\n")["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("gloo.timeout", "collective_timeout", 3)
    # node 0's console alone, under the command that started it (fault22_nodes.py runs each node's
    # torchrun so): every rank in it timed out; the reading says whose console is missing
    command = "$ torchrun --nnodes=2 --nproc-per-node=3 --node-rank=0 fault22.py --fault stall --rank 3"
    rc = _report(tmp_path / "node0.log", "\n".join([command] + node0) + "\n")["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("gloo.timeout", None)
    assert any("ranks 3–5 print nothing" in reason for reason in rc["reasons"])


def _stopped_workers_log(world: int, culprit: int, sent: list[int]) -> str:
    """torchrun's teardown after rank `culprit` raised (torch 2.13 format, sample_logs/cpu/
    rank_exception__np4): its `Sending process P closing signal SIGTERM` for the pids in `sent`,
    then the summary: the other workers at -15, the culprit's exit 1 as Root Cause."""
    agent = "W1202 08:00:01.000000 100 torch/distributed/elastic/multiprocessing/api.py:1028] "
    pid = {r: 1000 + r for r in range(world)}
    entry = ("[{i}]:\n  time      : 2026-12-02_08:00:02\n  host      : node01\n  rank      : {r} (local_rank: {r})\n"
             "  exitcode  : {code} (pid: {p})\n  error_file: <N/A>\n  traceback : {tb}\n")
    rule = "-" * 60 + "\n"
    text = (f"[rank{culprit}]: Traceback (most recent call last):\n"
            f'[rank{culprit}]:   File "/job/train.py", line 40, in <module>\n[rank{culprit}]:     batch = data["target"]\n'
            f"[rank{culprit}]: KeyError: 'target'\n")
    text += "".join(f"{agent}Sending process {pid[r]} closing signal SIGTERM\n" for r in sent)
    text += (f"E1202 08:00:02.000000 100 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) "
             f"local_rank: {culprit} (pid: {pid[culprit]}) of binary: /venv/bin/python3\n")
    text += ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n" + "=" * 60 + "\ntrain.py FAILED\n"
             + rule + "Failures:\n")
    others = [r for r in range(world) if r != culprit]
    text += "".join(entry.format(i=i, r=r, code=-15, p=pid[r], tb="Signal 15 (SIGTERM) received by PID " + str(pid[r]))
                    for i, r in enumerate(others, 1))
    text += rule + "Root Cause (first observed failure):\n"
    text += entry.format(i=0, r=culprit, code=1, p=pid[culprit], tb="To enable traceback see: https://x") + "=" * 60 + "\n"
    return text


def test_the_agents_sigterms_to_a_thousand_workers_are_all_counted_and_a_trimmed_list_proves_nothing(tmp_path):
    # a 128-rank run: torchrun names every worker it stops; the findings keep a rule's first 50
    # lines per stream, but every pid counts (docs/research/gaps44.md S1), so no worker's -15 was
    # "unsent"
    report = _report(tmp_path / "big.log", _stopped_workers_log(128, 97, [r for r in range(128) if r != 97]))
    assert not [f for f in report["findings"] if f["rule_id"] == "signal.sigterm_unsent"]
    rc = report["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("python.exception", "python_exception", 97)
    # a paste that keeps one `Sending process` line of many: the others' -15s are not unsent
    report = _report(tmp_path / "trimmed.log", _stopped_workers_log(16, 5, [0]))
    assert not [f for f in report["findings"] if f["rule_id"] == "signal.sigterm_unsent"]
    assert (report["root_cause"]["rule_id"], report["root_cause"]["rank"]) == ("python.exception", 5)
    # one worker of eight stopped from outside before the teardown: its SIGTERM is its own end
    log = _stopped_workers_log(8, 5, [r for r in range(8) if r not in (5, 3)])
    report = _report(tmp_path / "outside.log", log)
    assert {f["rank"] for f in report["findings"] if f["rule_id"] == "signal.sigterm_unsent"} == {3}
    assert (report["root_cause"]["rule_id"], report["root_cause"]["rank"]) == ("python.exception", 5)


def _hard_wrapped(path: str, width: int) -> str:
    """A log as a terminal `width` columns wide shows it, copied row by row (docs/research/gaps42.md,
    the wrap80/wrap120 shapes; real ones: sample_logs/public29/deepspeedexamples964_*_hard_wrapped_lines)."""
    rows = []
    for line in open(path, encoding="utf-8").read().splitlines():
        rows += [line[i:i + width] for i in range(0, len(line), width)] or [""]
    return "\n".join(rows) + "\n"


def test_a_hard_wrapped_paste_is_read_as_the_lines_the_program_printed(tmp_path):
    # sample_logs/cpu/rank_sigkill__np4 (rank 3 SIGKILLed; the others' gloo errors follow). Cut at 120
    # columns, rank 2's `RuntimeError: [...]/pair.cc:537] Read error [127.0.0.1]:219` kept half of its
    # message and read as a bare exception; rejoined, it is a peer's consequence again
    for width in (80, 120):
        report = _report(tmp_path / f"wrap{width}.log", _hard_wrapped("sample_logs/cpu/rank_sigkill__np4.log", width))
        rc = report["root_cause"]
        assert (rc["rule_id"], rc["category"], rc["rank"]) == ("signal.sigkill", "crash_signal", 3)
        rows = (tmp_path / f"wrap{width}.log").read_text().count("\n")
        assert report["input_lines"] == rows == sum(s["lines"] for s in report["streams"])


def test_an_agents_lost_rendezvous_is_the_root_only_before_the_workers_collectives_failed():
    # sample_logs/cpu_adhoc/store_dies_np6_rall_srun2: node 0's agent (the store's host) SIGKILLed;
    # node 1's agent loses the store, then node 0's orphaned workers lose their peers: the lost
    # store came first and is the root
    rc = triage(["sample_logs/cpu_adhoc/store_dies_np6_rall_srun2.log"]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["category"]) == ("dist.rendezvous_connection", "rendezvous")
    # sample_logs/cpu_adhoc/barrier_sleep_np8_r7_tee_2n (each node's console a file): rank 7 slept past
    # the barrier's timeout; node 0's workers timed out, its agent exited, and node 1's agent then
    # lost the store: the timeouts came first and name rank 7
    rc = triage(["sample_logs/cpu_adhoc/barrier_sleep_np8_r7_tee_2n"]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("gloo.timeout", "collective_timeout", 7)


def test_after_restarts_the_last_attempts_own_failure_is_the_root():
    # sample_logs/cpu_adhoc/resume_size_np4_r2_plain (torchrun --max-restarts 1, its INFO lines off):
    # attempt 0, rank 2's KeyError; attempt 1 resumed and rank 2's checkpoint held another size.
    # The one agent's two `failed (exitcode: 1)` lines mark the restart; the run died of the resume
    report = triage(["sample_logs/cpu_adhoc/resume_size_np4_r2_plain.log"]).to_dict()
    rc = report["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("ckpt.size_mismatch", "checkpoint", 2)
    assert {(r["rank"], r["attempt"]) for r in report["ranks"]} >= {(2, 0), (2, 1)}
    # sample_logs/cpu_adhoc/once_key_np6_r5_redirects (a --log-dir folder, its console beside it):
    # attempt 0's KeyError, then every rank of attempt 1 finished: the job succeeded
    folder = "sample_logs/cpu_adhoc/once_key_np6_r5_redirects"
    report = triage([folder, folder + ".console.log"]).to_dict()
    assert report["verdict"] == "ok" and report["root_cause"] is None


def test_a_failure_the_script_caught_is_recovered_when_every_rank_then_finishes(tmp_path):
    # real CPU runs (sample_logs/cpu_adhoc/printexc_continue_np6_r2_role): traceback.print_exc() and
    # continue; every rank logs that it finished, every worker exits 0, no summary
    log = tmp_path / "caught.log"
    caught = ("[trainer2]:Traceback (most recent call last):\n"
              '[trainer2]:  File "/tmp/job/fault29.py", line 176, in main\n'
              "[trainer2]:RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x7 and 8x16)\n")
    lost = "[trainer{r}]:RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer\n"
    done = "[trainer{r}]:2026-12-02 11:58:11,663 - trainer - INFO - training finished\n"
    body = caught + done.format(r=2) + "".join(lost.format(r=r) + done.format(r=r) for r in (0, 1, 3))
    report = _report(log, body)
    assert (report["verdict"], report["root_cause"]) == ("ok", None)
    back = report["recovered"]
    assert (back["rule_id"], back["rank"], back["exception_type"]) == ("python.exception", 2, "RuntimeError")
    # one rank never says it finished: the run is not known to have got over it
    report = _report(log, body.replace(done.format(r=3), ""))
    assert (report["verdict"], report["root_cause"]["rank"]) == ("failed", 2)
    # an agent that saw a worker fail: not caught
    agent = ("E1202 11:58:12.000000 3816 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
             "(exitcode: 1) local_rank: 2 (pid: 3826) of binary: /tmp/venv/bin/python3\n")
    assert _report(log, body + agent)["verdict"] == "failed"


def test_a_handler_that_fails_while_handling_is_not_the_root(tmp_path):
    # real CPU run (sample_logs/cpu_adhoc/emergency_ckpt_np4_r3_plain): an on_exception hook saves an
    # emergency checkpoint into a folder that does not exist, on the culprit and on its lost peers
    log = tmp_path / "hook.log"
    def chained(rank: int, first: str) -> str:
        p = f"[rank{rank}]: "
        return (f"{p}Traceback (most recent call last):\n{p}  File \"/tmp/job/fault29.py\", line 205, in main\n{p}{first}\n"
                f"\n{p}During handling of the above exception, another exception occurred:\n\n"
                f"{p}Traceback (most recent call last):\n{p}  File \"/tmp/job/fault29.py\", line 148, in on_exception\n"
                f"{p}    torch.save(state, path)\n{p}RuntimeError: Parent directory /mnt/ckpt/emergency does not exist.\n")
    lost = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:52610"
    report = _report(log, chained(3, "RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x7 and 8x16)")
                     + chained(0, lost) + chained(2, lost))
    rc = report["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("python.exception", "python_exception", 3)
    assert "mat1 and mat2" in rc["text"]
    # alone (no peer handled a lost connection the same way), the handler's exception is still its own
    # call's (raised in `on_exception`, a function the first exception never passed through)
    alone = chained(3, "RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x7 and 8x16)")
    assert _report(log, alone)["root_cause"]["rule_id"] == "python.exception"
    # a handler that raises its own, plainer error about the first from the function that caught it is
    # a library's word for it (a KeyError read as "model type not recognised"): that one is reported
    # (its `raise` in the same function: a handler whose own call fails there, `os.remove(path)` in a
    # `finally:`, is read by the first exception instead; stop 33's chained-exception runs)
    reworded = alone.replace('in on_exception\n', 'in main\n').replace(
        'torch.save(state, path)', 'raise RuntimeError(f"Parent directory {folder} does not exist.")')
    assert _report(log, reworded)["root_cause"]["rule_id"] == "ckpt.write_failed"
    # an exception raised "from" another (an explicit cause) is the one reported, as before
    direct = chained(3, "KeyError: 'y'").replace(
        "During handling of the above exception, another exception occurred:",
        "The above exception was the direct cause of the following exception:")
    assert _report(log, direct)["root_cause"]["rule_id"] == "ckpt.write_failed"


def test_a_caught_error_is_recovered_when_the_agent_then_says_its_worker_group_succeeded(tmp_path):
    # real CPU run (sample_logs/cpu_adhoc/end_ctrl_nodestroy_np5_r2_loglevel, LOGLEVEL=INFO): an optional
    # metrics push fails after training, printed with print_exc(); every worker exits 0
    log = tmp_path / "pushed.log"
    body = ("2026-12-02 15:55:59,687 INFO [rank0] train: Training complete: 6 steps in 0.4s, final loss 1.3544\n"
            "Traceback (most recent call last):\n"
            '  File "/tmp/job/fault33.py", line 338, in end_phase\n'
            'RuntimeError: metrics push: server returned HTTP 503 Service Unavailable\n')
    succeeded = ("I1202 15:56:02.528000 19628 torch/distributed/elastic/agent/server/api.py:932] [default] worker "
                 "group successfully finished. Waiting 300 seconds for other agents to finish.\n")
    report = _report(log, body + succeeded)
    assert (report["verdict"], report["root_cause"]) == ("ok", None)
    assert report["recovered"]["exception_type"] == "RuntimeError"
    assert any("worker group succeeded" in n for n in report["notes"])
    # the agent's word before the error says nothing of it
    assert _report(log, succeeded + body)["verdict"] == "failed"
    # a NaN loss fails the run though every worker exits 0 (cpu_matrix's loglevel_info NaN runs)
    nan = "[rank1]: step 3 loss nan grad_norm nan\n"
    report = _report(log, nan + succeeded)
    assert (report["verdict"], report["root_cause"]["rule_id"]) == ("failed", "numerical.loss_nan")


def test_srun_task_exits_of_agents_yield_to_the_workers_lost_peers(tmp_path):
    # real CPU run (sample_logs/cpu_adhoc/end_destroy_partial_np6_r2_srun2): one torchrun agent per srun
    # task; rank 2 destroyed its group and exited 0 while the others still ran a collective
    report = triage(["sample_logs/cpu_adhoc/end_destroy_partial_np6_r2_srun2.log"]).to_dict()
    rc = report["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("gloo.connection_closed", "collective_error", 2)
    # the agents' `failed (exitcode: 1) local_rank: N` lines join their ranks' own rows
    assert sorted(r["rank"] for r in report["ranks"]) == [0, 1, 2, 3, 4, 5]


def test_ddp_model_check_on_every_rank_names_the_rank_whose_count_differs(tmp_path):
    # torch 2.13 CPU run (sample_logs/cpu_adhoc/start_ddp_count_np6_r0_role): rank 0 built 6 parameter
    # tensors, the others 4; every rank raises the same check, printed in the order 3, 2, 0, 1
    frame = ('  File "/tmp/venv/lib/python3.11/site-packages/torch/distributed/utils.py", line 300, in '
             '_verify_param_shape_across_processes\n')
    text = ""
    for rank, own, other, other_count in ((3, 4, 0, 6), (2, 4, 0, 6), (0, 6, 1, 4), (1, 4, 0, 6)):
        text += "".join(f"[trainer{rank}]:[rank{rank}]: {line}\n" for line in (
            "Traceback (most recent call last):", frame.rstrip("\n"),
            "    return dist._verify_params_across_processes(process_group, tensors, logger)",
            f"RuntimeError: DDP expects same model across all ranks, but Rank {rank} has {own} params, while "
            f"rank {other} has inconsistent {other_count} params."))
    rc = _report(tmp_path / "r.log", text)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("ddp.param_shape_mismatch", "ddp_usage", 0)


def test_a_bare_stop_iteration_is_the_ranks_exception(tmp_path):
    # torch 2.13 CPU run (sample_logs/cpu_adhoc/start_loader_empty_np5_r0_plain): next(iter(loader)) on a
    # shard smaller than one batch; the exception line is the type alone
    text = "".join(f"[rank0]: {line}\n" for line in (
        "Traceback (most recent call last):", '  File "/tmp/job/fault34.py", line 217, in load_data',
        "    first = next(iter(loader))", "StopIteration"))
    rc = _report(tmp_path / "r.log", text)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["exception_type"], rc["line"]) == (
        "python.exception", "python_exception", 0, "StopIteration", 4)


def test_every_rank_saying_done_with_its_closing_figure_is_a_finished_run(tmp_path):
    # torch 2.13 CPU run (sample_logs/cpu_adhoc/start_ctrl_warn_np4_rall_plain), exit 0 and no line of torchrun's
    text = "".join(f"[rank {r}] step {s}/2 loss 1.{r}{s}\n" for s in (1, 2) for r in range(3))
    text += "".join(f"[rank {r}] done, final loss 1.{r}2\n" for r in range(3))
    assert _report(tmp_path / "r.log", text)["verdict"] == "ok"
    stopped = text.replace("done, final loss", "done loading, final loss")
    assert _report(tmp_path / "s.log", stopped)["verdict"] == "hung"


def test_a_stop_iteration_a_generator_turned_into_runtime_error_yields_to_it(tmp_path):
    # torch 2.13 CPU run (sample_logs/cpu_adhoc/gen_stopiter_np4_r3_runmodule): PEP 479 chains the
    # generator's StopIteration to `RuntimeError: generator raised StopIteration`, which ends the rank
    text = "".join(f"[rank3]: {line}\n" for line in (
        "Traceback (most recent call last):", '  File "/tmp/job/fault.py", line 40, in batches',
        "    yield next(it)", "StopIteration", "",
        "The above exception was the direct cause of the following exception:", "",
        "Traceback (most recent call last):", '  File "/tmp/job/fault.py", line 80, in main',
        "    for batch in batches(loader):", "RuntimeError: generator raised StopIteration"))
    rc = _report(tmp_path / "r.log", text)["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["exception_type"], rc["line"]) == ("python.exception", 3, "RuntimeError", 11)


def test_a_loss_still_nan_at_the_last_step_is_no_recovery_though_every_rank_finished(tmp_path):
    # torch 2.13 CPU run (sample_logs/cpu_adhoc/num_divzero_silent_np4_r3_plain): rank 2's loss goes NaN,
    # DDP spreads it, every rank prints `loss nan` to the end, says it finished and exits 0
    text = "".join(f"rank {r} step 1/3 loss 1.{r}\n" for r in range(3)) + "rank 2 step 2/3 loss nan\n"
    text += "".join(f"rank {r} step 2/3 loss 1.{r}\n" for r in (0, 1))
    text += "".join(f"rank {r} step 3/3 loss nan\n" for r in range(3))
    text += "".join(f"rank {r}: training finished\n" for r in range(3))
    report = _report(tmp_path / "r.log", text)
    assert (report["verdict"], report["root_cause"]["rule_id"], report["root_cause"]["rank"]) == (
        "failed", "numerical.loss_nan", 2)
    healed = text.replace("rank 0 step 3/3 loss nan", "rank 0 step 3/3 loss 0.9").replace(
        "rank 1 step 3/3 loss nan", "rank 1 step 3/3 loss 0.8").replace("rank 2 step 3/3 loss nan", "rank 2 step 3/3 loss 0.7")
    assert _report(tmp_path / "h.log", healed)["verdict"] == "ok"   # a NaN the run got over


def test_a_loss_that_went_inf_before_the_grad_norm_is_the_first_sign(tmp_path):
    # torch 2.13 CPU run (sample_logs/cpu_adhoc/num_lr_silent_np4_r0_hf), the HF Trainer's log dicts
    text = "".join(f"{{'loss': {loss}, 'grad_norm': {norm}, 'learning_rate': 100.0, 'epoch': {e}}}\n"
                   for loss, norm, e in (("1.42", "2.5", 0.1), ("5.2e+31", "3.6e+15", 0.2), ("inf", "8.7e+18", 0.3),
                                         ("inf", "inf", 0.4)))
    rc = _report(tmp_path / "r.log", text + "training finished\n")["root_cause"]
    assert (rc["rule_id"], rc["line"]) == ("numerical.loss_nan", 3)


def test_a_nan_loss_on_the_last_steps_bar_is_no_recovery(tmp_path):
    # torch 2.13 CPU run (sample_logs/cpu_adhoc/num_nan_silent_np3_r1_plain): tqdm bars with no rank label end
    # at 8/8 with loss=nan, then every rank says it finished and torchrun exits 0
    bar = "train: 100%|██████████| 8/8 [00:02<00:00,  3.16it/s, gnorm=nan, loss=nan]\n"
    text = "".join(f"rank {r} step 1/8 loss 1.{r}\n" for r in range(3)) + bar + bar
    text += "".join(f"rank {r}: training finished\n" for r in range(3))
    report = _report(tmp_path / "r.log", text)
    assert (report["verdict"], report["root_cause"]["rule_id"]) == ("failed", "numerical.loss_nan")


def test_a_json_records_escaped_traceback_gives_its_exception(tmp_path):
    # torch 2.13 CPU run (sample_logs/cpu_adhoc/fmt_json_key_np5_r4_tee and fmt_json_nan_np3_r0_plain): one JSON
    # record per line, the traceback one escaped string in "exc_info"
    def record(rank: int, last: str) -> str:
        return ('{"ts": "2026-12-02T21:33:35.619", "level": "ERROR", "rank": %d, "msg": "step failed", "exc_info": '
                '"Traceback (most recent call last):\\n  File \\"/tmp/job/fault36.py\\", line 138, in train_step\\n'
                '    loss = F.mse_loss(out, b[\\"y\\"])\\n%s"}\n' % (rank, last))
    rc = _report(tmp_path / "k.log", "[default2]:" + record(2, "KeyError: 'y'"))["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["exception_type"]) == ("python.exception", 2, "KeyError")
    rc = _report(tmp_path / "n.log", "[default0]:" + record(0, "FloatingPointError: loss is nan at step 3"))["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["exception_type"]) == ("numerical.checked_nonfinite", 0, "FloatingPointError")


def test_errors_as_renderers_print_them(tmp_path):
    # torch 2.13 CPU runs of sample_logs/cpu_adhoc/fmt_*: a script's one-line excepthook, a record logged with its
    # header on every traceback line, rich's traceback that wraps the message below `RuntimeError: `
    rc = _report(tmp_path / "h.log", "[rank2]: [rank 2] FATAL RuntimeError('[/__w/pytorch/pytorch/third_party/gloo/gloo/"
                 "transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5531.')\n"
                 "[rank3]: [rank 3] FATAL KeyError('y') at fault36.py:138\n")["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["exception_type"]) == ("python.exception", 3, "KeyError")
    head = "[default7]:2026-12-02 21:39:13,183 ERROR   [rank 7] "
    text = "".join(head + line + "\n" for line in (
        "train: step failed", "Traceback (most recent call last):", '  File "/tmp/job/fault36.py", line 144, in train_step',
        '    raise FloatingPointError(f"loss is {loss.item()} at step {step}")',
        "FloatingPointError: loss is nan at step 3"))
    rc = _report(tmp_path / "l.log", text)["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["line"], rc["exception_type"]) == ("numerical.checked_nonfinite", 7, 5, "FloatingPointError")
    text = "".join(f"[default|r2] [rank2]: {line}\n" for line in (
        "╭──── Traceback (most recent call last) ────╮", "│ /tmp/job/fault36.py:173 in main            │",
        "╰───────────────────────────────────────────╯", "RuntimeError: ",
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] ",
        "Timed out waiting 15000ms for recv operation to complete"))
    rc = _report(tmp_path / "r.log", text)["root_cause"]
    assert (rc["rule_id"], rc["line"]) == ("gloo.timeout", 6)   # (a timeout alone: the rank is the one it waited for)


_AGENT = "W1203 01:04:35.396000 6928 torch/distributed/elastic/"


def _heartbeats(rounds: int, odd: int, ranks: int = 4) -> str:
    """A DDP loop's heartbeat thread (cpu_adhoc 38th batch, `fault38.py`): every rank prints
    `alive step 3 phase backward` while it waits in the all-reduce, the stalled rank `phase data`."""
    return "".join(f"[rank {r}] alive step 3 phase {'data' if r == odd else 'backward'}\n"
                   for _ in range(rounds) for r in range(ranks))


def _stopped_by(signal: int) -> str:
    """torchrun's lines when `timeout -s INT|TERM` stops it (stall_sleepint_np4_r1_plain and
    stall_spinterm_np5_r2_tee)."""
    return (f"{_AGENT}agent/server/api.py:753] Received {signal} death signal, shutting down workers\n"
            + "".join(f"{_AGENT}multiprocessing/api.py:1028] Sending process {6947 + r} closing signal "
                      f"{'SIGINT' if signal == 2 else 'SIGTERM'}\n" for r in range(4))
            + "torch.distributed.elastic.multiprocessing.api.SignalException: Process 6928 got signal: "
            + f"{signal}\n")


def test_heartbeats_at_one_step_before_a_stop_are_a_hang_of_the_odd_rank(tmp_path):
    steps = "".join(f"[rank {r}] step {s} loss 0.9\n" for s in (1, 2) for r in range(4))
    report = _report(tmp_path / "r.log", steps + "[rank 1] step 3: fetching shard 3\n" + _heartbeats(4, odd=1)
                     + _stopped_by(15))
    rc = report["root_cause"]
    assert (report["verdict"], rc["rule_id"], rc["category"], rc["rank"]) == (
        "hung", "hang.stopped_while_waiting", "hang", 1)
    assert any("heartbeat" in r for r in rc["reasons"])


def test_a_stop_while_steps_still_advance_stays_an_external_stop(tmp_path):
    steps = "".join(f"[rank {r}] step {s} loss 0.9\n[rank {r}] alive step {s} phase backward\n"
                    for s in range(1, 6) for r in range(4))
    report = _report(tmp_path / "r.log", steps + _stopped_by(2))
    assert (report["verdict"], report["root_cause"]["category"]) == ("failed", "external_stop")


def test_two_heartbeats_are_not_yet_a_stall(tmp_path):
    report = _report(tmp_path / "r.log", _heartbeats(2, odd=1) + _stopped_by(15))
    assert report["root_cause"]["category"] == "external_stop"


def test_a_scripts_progress_watchdog_is_a_hang_on_its_rank(tmp_path):
    # stall_wdexit_np4_r2_plain: the stalled rank's own watchdog exits 3; its peers lose the connection
    log = ("[rank 2] step 3: fetching shard 3 from object store\n"
           "[rank 2] rank 2 no progress for 8s at step 3 (phase data)\n[rank 2] watchdog: exiting with code 3\n"
           "[rank3]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
           "Connection closed by peer [127.0.0.1]:8883\n")
    rc = _report(tmp_path / "r.log", log)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"], rc["line"]) == ("hang.watchdog_heartbeat", "hang", 2, 2)


def test_watchdogs_on_every_rank_but_one_point_at_that_one(tmp_path):
    # stall_wdwaiter_np5_r1_tee: the waiters' watchdogs fire; the stalled rank 1 is the one without
    log = "".join(f"[default{r}]:r{r} | step 2/6 loss=0.9\n" for r in range(5))
    log += "".join(f"[default{r}]:r{r} | rank {r} no progress for 8s at step 3 (phase backward)\n"
                   for r in (4, 0, 3, 2))
    log += "[default1]:r1 | alive step 3 phase data\n"
    rc = _report(tmp_path / "r.log", log)["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("hang.watchdog_heartbeat", 1)


def test_a_store_wait_for_an_address_at_group_formation_stays_a_start_up_failure(tmp_path):
    # coll_localrank_np6_r3_srun, on one node: every rank's `step 0/6 init_process_group(...)` line,
    # then gloo's connectFullMesh waits in the store for rank 2's address, which no process published
    log = "".join(f"[rank {r}] step 0/6 init_process_group(rank={r % 2}, world_size=4)\n" for r in range(4))
    log += ("Traceback (most recent call last):\ntorch.distributed.DistStoreError: wait timeout after 15000ms, "
            "keys: /default_pg/0//cpu//0/2\n") * 4
    rc = _report(tmp_path / "r.log", log)["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("dist.store_wait_timeout", "rendezvous", 2)


def _tb(rank: int, exception: str) -> str:
    return (f"[rank{rank}]: Traceback (most recent call last):\n[rank{rank}]:   File \"/tmp/job/fault42.py\", line 84, "
            f"in load_batch\n[rank{rank}]:     return batch[\"y\"]\n[rank{rank}]: {exception}\n")


def test_a_rank_that_logged_its_error_first_failed_first_though_its_traceback_comes_last(tmp_path):
    # ord_three_np6_r3_plain: rank 3 logs its KeyError at step 2, lingers (an emergency checkpoint) and
    # raises last; rank 0's ZeroDivisionError at step 4 is printed first
    log = "".join(f"[rank {r}] step 2/8 loss 1.4\n" for r in (0, 1, 2))
    log += "[rank 3] ERROR step 2 failed (KeyError); writing an emergency checkpoint before exiting\n"
    log += "".join(f"[rank {r}] step 3/8 loss 1.3\n" for r in (0, 1, 2))
    log += _tb(0, "ZeroDivisionError: division by zero") + _tb(3, "KeyError: 'y'")
    rc = _report(tmp_path / "r.log", log)["root_cause"]
    assert (rc["rank"], rc["exception_type"]) == (3, "KeyError")


def test_a_rank_killed_before_its_traceback_is_dated_by_its_logged_error(tmp_path):
    # ord_key_val_np4_r2_plain: rank 2's ERROR record is all it printed; rank 1's ValueError came a step later
    log = ("[rank 1] step 2/8 loss 1.4\n[rank 2] ERROR step 2 failed (KeyError); writing an emergency checkpoint "
           "before exiting\n[rank 3] step 2/8 loss 1.3\n" + _tb(1, "ValueError: could not convert string to float: 'n/a'"))
    rc = _report(tmp_path / "r.log", log)["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("python.logged_error", 2)


def test_a_logged_record_above_a_lost_peer_is_no_first_sign(tmp_path):
    # skip_allreduce-like: every rank logs `training failed` and then its own gloo timeout
    log = "".join(f"2026-12-02 05:02:03,514 [ERROR] rank {r}: training failed at step 3\n[rank{r}]: RuntimeError: "
                  "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 15000ms for recv "
                  "operation to complete\n" for r in (0, 1, 3))
    rc = _report(tmp_path / "r.log", log)["root_cause"]
    assert rc["category"] == "collective_timeout"


def test_a_silent_exit_a_step_before_everyone_else_came_first(tmp_path):
    # ord_osexit_index_np6_r5_prefix: rank 5 os._exit(1)s at step 2 with no line; rank 2 raises at step 3
    log = "".join(f"[rank {r}] step 1/8 loss 1.4\n" for r in range(4))
    log += "".join(f"[rank {r}] step 2/8 loss 1.3\n" for r in (0, 1, 2))
    log += _tb(2, "IndexError: index 16 is out of bounds for dimension 0 with size 16")
    log += _summary("[{i}]:\n  time      : 2026-12-03_02:03:10\n  host      : localhost\n  rank      : {r} "
                    "(local_rank: {r})\n  exitcode  : 1 (pid: 10{r})\n  error_file: <N/A>\n  traceback : To enable "
                    "traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n", (2, 3), 2)
    rc = _report(tmp_path / "r.log", log)["root_cause"]
    assert (rc["category"], rc["rank"]) == ("unknown", 3)


def test_a_logging_formats_level_then_rank_names_the_rank(tmp_path):
    # ord_index_key_np3_r0_loglevel_log: `[ERROR] rank 0: step 2 failed (IndexError); ...`
    from logtriage.demux.line_marks import find_rank_marker
    assert find_rank_marker("2026-12-03 02:06:09,292 [ERROR] rank 4: step 2 failed (KeyError)") == 4
    assert find_rank_marker("RuntimeError: timed out waiting for rank 3: closed") is None
