"""Lines that look like errors in runs that went on: they must not become the root, and a real
failure after them still must (gaps round 41; each case names the format it copies)."""

from __future__ import annotations

import pytest

from logtriage.api import triage

FINISHED = "".join(f"[rank{r}]:step 100 loss 1.234\n[rank{r}]:training finished\n" for r in range(4))
OOM = ("[rank2]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 2 has a total capacity "
       "of 79.15 GiB of which 1.02 GiB is free.\n")


@pytest.mark.parametrize("line", [
    # Megatron-Core's gpt_layer_specs.py, through Python logging's default format
    "[rank0]:WARNING:megatron.core.models.gpt.gpt_layer_specs:Apex is not installed. Falling back to Torch Norm\n",
    # huggingface_hub's http_backoff retry notice, then its wait
    "[rank0]:'(ReadTimeoutError(\"HTTPSConnectionPool(host='huggingface.co', port=443): Read timed out. "
    "(read timeout=10)\"), '(Request ID: 0b3c5e2a-7f1d-4a4e-9d2b-1f2e3d4c5b6a)')' thrown while requesting HEAD "
    "https://huggingface.co/meta-llama/Llama-3.1-8B/resolve/main/config.json\n[rank0]:Retrying in 1s [Retry 1/5].\n",
    # NCCL skipping one HCA of several (transport/net_ib), then naming the devices it uses
    "[rank0]:node01:1235:1290 [0] misc/ibvwrap.cc:212 NCCL WARN Call to ibv_open_device failed\n"
    "[rank0]:node01:1235:1290 [0] transport/net_ib/init.cc:334 NCCL WARN NET/IB : Unable to open device mlx5_58\n"
    "[rank0]:node01:1235:1290 [0] NCCL INFO NET/IB : Using [0]mlx5_1:1/RoCE [1]mlx5_2:1/RoCE ; OOB eth0:10.0.0.1<0>\n"
    "[rank0]:node01:1235:1290 [0] NCCL INFO Using network IB\n",
    # Inductor max-autotune dropping one candidate kernel (select_algorithm.py's log.error)
    "[rank0]:E1201 10:00:05.000000 1200 torch/_inductor/select_algorithm.py:2210] Runtime error during autotuning: \n"
    "[rank0]:CUDA error: invalid argument\n[rank0]:For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "[rank0]:. \n[rank0]:Ignoring this choice.\n",
])
def test_a_warning_the_run_went_on_from_is_not_the_root(tmp_path, line):
    log = tmp_path / "run.log"
    log.write_text(line + FINISHED)
    assert triage([str(log)]).to_dict()["verdict"] == "ok"
    log.write_text(line + OOM)
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["category"], rc["rank"]) == ("cuda.oom", "gpu_oom", 2)


def test_the_same_texts_raised_still_fail_the_run(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("[rank0]: ModuleNotFoundError: No module named 'apex'\n")
    assert triage([str(log)]).to_dict()["root_cause"]["rule_id"] == "env.fused_kernels_missing"
    log.write_text("[rank0]: requests.exceptions.ReadTimeout: (ReadTimeoutError(\"HTTPSConnectionPool(host="
                   "'huggingface.co', port=443): Read timed out. (read timeout=10)\"), '(Request ID: 0b6f1c2e-9d3a)')\n")
    assert triage([str(log)]).to_dict()["root_cause"]["rule_id"] == "env.hub_unreachable"


def test_a_device_nccl_could_not_open_fails_the_run_when_nothing_follows(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("[rank0]:node01:1235:1290 [0] transport/net_ib/init.cc:334 NCCL WARN NET/IB : Unable to open "
                   "device mlx5_0\n[rank0]:node01:1235:1290 [0] NCCL WARN Failed to initialize any NET plugin\n")
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["line"]) == ("nccl.net_setup", 0, 1)


def test_another_process_going_on_does_not_clear_the_device_error(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("node01:1235:1290 [0] transport/net_ib/init.cc:334 NCCL WARN NET/IB : Unable to open device mlx5_0\n"
                   "node01:1236:1291 [1] NCCL INFO Using network IB\n")
    assert triage([str(log)]).to_dict()["root_cause"]["rule_id"] == "nccl.net_setup"


@pytest.mark.parametrize("hook", [
    # wandb's atexit hook writing to its service after it quit
    ["Traceback (most recent call last):", '  File "/usr/lib/python3.11/site-packages/wandb/sdk/wandb_run.py", '
     'line 2380, in _atexit_cleanup', "    self._on_finish()", "BrokenPipeError: [Errno 32] Broken pipe"],
    # matplotlib's Tk figure manager finalised from the wrong thread at exit
    ["Traceback (most recent call last):", '  File "/usr/lib/python3.11/tkinter/__init__.py", line 410, in __del__',
     "    self._tk.call('info', 'exists', self._name)", "RuntimeError: main thread is not in main loop"],
])
def test_an_atexit_hook_raising_after_the_run_is_not_the_root(tmp_path, hook):
    block = "".join(f"[rank0]:{line}\n" for line in ["Error in atexit._run_exitfuncs:", *hook])
    log = tmp_path / "run.log"
    log.write_text(FINISHED + block)
    assert triage([str(log)]).to_dict()["verdict"] == "ok"
    log.write_text(OOM + block)
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("cuda.oom", 2)


def test_the_reporters_own_words_around_a_pasted_hang_are_not_its_error(tmp_path):
    # an issue's prose before and after the paste (docs/research/gaps42.md): the log itself stops
    # after step 100 with no error, a hang
    log = tmp_path / "run.log"
    log.write_text("I get the following error when running on 4 GPUs with torchrun:\n\n"
                   + "".join(f"[rank{r}]:step 100 loss 1.234\n" for r in range(4))
                   + "\nAny idea? I already tried NCCL_P2P_DISABLE=1, it still fails with the same error.\n")
    report = triage([str(log)]).to_dict()
    assert (report["verdict"], report["root_cause"]["rule_id"], report["root_cause"]["line"]) == \
        ("hung", "hang.output_stopped", 6)


COLLECT_ENV = """Collecting environment information...
PyTorch version: 2.5.1+cu124
Is debug build: False
CUDA used to build PyTorch: 12.4
OS: Ubuntu 22.04.4 LTS (x86_64)
Python version: 3.11.10 (main, Oct  3 2024, 07:29:13) [GCC 11.2.0] (64-bit runtime)
Is CUDA available: True
GPU models and configuration:
GPU 0: NVIDIA A100-SXM4-80GB
Nvidia driver version: 550.90.07
CPU:
Model name:                         Intel(R) Xeon(R) Platinum 8358 CPU @ 2.60GHz
Versions of relevant libraries:
[pip3] numpy==1.26.4
[pip3] torch==2.5.1
[conda] torch                     2.5.1                    pypi_0    pypi
"""


def test_collect_envs_report_under_the_log_is_neither_job_output_nor_a_convention(tmp_path):
    # an issue template's "### Versions" under the paste (docs/research/gaps42.md): a short srun
    # log keeps its labels' ranks, and a hang's last line is the log's
    srun = "".join(f"{r}: step 3 loss 0.5\n" for r in range(4)) + \
        "1: RuntimeError: DataLoader worker (pid 1901937) is killed by signal: Aborted.\n"
    log = tmp_path / "run.log"
    log.write_text(srun + "\n### Versions\n\n" + COLLECT_ENV)
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["rank"]) == ("data.loader_worker_died", 1)
    # a run that stops after its steps: the hang's last line is the log's, not the report's
    log.write_text("".join(f"[rank{r}]:step 100 loss 1.234\n" for r in range(4)) + "\n### Versions\n\n" + COLLECT_ENV)
    report = triage([str(log)]).to_dict()
    assert (report["verdict"], report["root_cause"]["line"]) == ("hung", 4)


# batch 30 of the real CPU runs (sample_logs/cpu_adhoc/herring_*): errors a script printed and went on
# from, then one real failure on another rank
REAL = ("[rank2]: Traceback (most recent call last):\n[rank2]:   File \"/tmp/job/fault30.py\", line 258, in main\n"
        "[rank2]: KeyError: 'y'\n"
        "[rank{r}]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer\n")


def _herring_run(herring: str) -> str:
    lines = [herring.format(r=r) for r in range(4)]
    lines += [f"rank {r} step {s} loss 1.{r}{s}\n" for s in (1, 2, 3) for r in range(4)]
    return "".join(lines) + "".join(REAL.format(r=r) for r in (0, 1, 3))


@pytest.mark.parametrize("herring", [
    # a caught exception each rank printed before training (a refused metrics connection)
    "Traceback (most recent call last):\n  File \"/tmp/job/fault30.py\", line 82, in metrics_connect\n"
    "ConnectionRefusedError: [Errno 111] Connection refused\nrank {r}: metrics disabled, training continues\n",
    # a logged error that says the program goes on
    "2026-12-02 12:13:40,600 - train - ERROR - rank {r}: metrics server unreachable; continuing without metrics\n",
    # logger.exception's record, then the traceback it logged
    "ERROR:train:rank {r}: eval hook failed at step 2; continuing\nTraceback (most recent call last):\n"
    "  File \"/tmp/job/fault30.py\", line 147, in evaluate\nZeroDivisionError: division by zero\n",
    # a flaky read retried
    "[rank{r}]: OSError: [Errno 5] Input/output error: '/data/shard00{r}.bin'\nrank {r}: shard read failed, retrying (1/3)\n",
])
def test_an_error_a_script_went_on_from_is_not_the_root(tmp_path, herring):
    log = tmp_path / "run.log"
    log.write_text(_herring_run(herring))
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert (rc["rule_id"], rc["rank"], rc["exception_type"]) == ("python.exception", 2, "KeyError")


def test_an_error_its_rank_went_on_from_is_not_the_root(tmp_path):
    # rank 2's caught evaluation error, then its own fatal KeyError (herring_evalhook_value_np4_r0_plain)
    caught = "[rank2]: Traceback (most recent call last):\n[rank2]: ZeroDivisionError: division by zero\n"
    progress = "".join(f"[rank{r}]: step {s} loss 1.{r}{s}\n" for s in (1, 2, 3) for r in range(4))
    log = tmp_path / "run.log"
    log.write_text(caught + progress + "".join(REAL.format(r=r) for r in (0, 1, 3)))
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert (rc["rank"], rc["exception_type"]) == (2, "KeyError")
    # with nothing else wrong, the caught error is still what the log has
    log.write_text(caught + progress)
    assert triage([str(log)]).to_dict()["root_cause"]["exception_type"] == "ZeroDivisionError"


def test_a_start_up_error_every_rank_printed_and_trained_after_is_not_the_root(tmp_path):
    # every rank's optional import fails before training; the agent stopped ranks 0, 1, 3 after rank 2's
    # KeyError (the summary's exit codes say which worker ended of its own failure)
    herring = "".join(f"[rank{r}]: Traceback (most recent call last):\n[rank{r}]: ModuleNotFoundError: "
                      f"No module named 'apex_fused_adam'\n" for r in range(4))
    progress = "".join(f"[rank{r}]: step {s} loss 1.{r}{s}\n" for s in (1, 2, 3) for r in range(4))
    summary = "".join(f"[{r}]:\n  time      : 2026-12-02_12:10:37\n  host      : vm\n  rank      : {r} (local_rank: {r})\n"
                      f"  exitcode  : {1 if r == 2 else -15} (pid: {100 + r})\n  error_file: <N/A>\n" for r in range(4))
    failed = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
              "============================================================\nfault30.py FAILED\n"
              "------------------------------------------------------------\nFailures:\n")
    log = tmp_path / "run.log"
    log.write_text(herring + progress + REAL.format(r=0) + failed + summary)
    rc = triage([str(log)]).to_dict()["root_cause"]
    assert (rc["rank"], rc["exception_type"]) == (2, "KeyError")
