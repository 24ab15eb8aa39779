"""Each prefix convention, on small real-format excerpts (sources: FORMATS.md §2, public issue logs)."""

from __future__ import annotations

import pytest

from logtriage.demux.prefixes import Dialect, strip_prefixes
from logtriage.demux.split import split_glued

PLAIN = Dialect()


@pytest.mark.parametrize("line, rank, local, text", [
    ("[rank1]: KeyError: 'target'", 1, None, "KeyError: 'target'"),                       # excepthook
    ("[rank0]:[I1130 00:01:08.161225451 reducer.cpp:132] Reducer initialized", 0, None,
     "[I1130 00:01:08.161225451 reducer.cpp:132] Reducer initialized"),                    # C++ log rank
    ("[default1]:[rank1]: Traceback (most recent call last):", 1, 1, "Traceback (most recent call last):"),
    ("[trainer0]:[rank 0] step 1 loss 0.1842", None, 0, "[rank 0] step 1 loss 0.1842"),   # --role trainer
    ("[rank0]:NotImplementedError: x", None, 0, "NotImplementedError: x"),                  # --role rank (torchtitan)
    ("[RANK 1] 2026-05-19 10:10:29,701 [ERROR] GPU circuit breaker OPEN", 1, None,          # SimpleTuner's label
     "2026-05-19 10:10:29,701 [ERROR] GPU circuit breaker OPEN"),
    ("[rank0]:[rank0]: Traceback (most recent call last):", 0, None, "Traceback (most recent call last):"),
    # a logging format's own rank label in front of each record
    ("[rank=2] KeyError: 'labels'", 2, None, "KeyError: 'labels'"),
    ("[rank: 1] Seed set to 42", 1, None, "Seed set to 42"),
    ("[rank=1|local=1] step 3", 1, 1, "step 3"),
    ("[gpu187:2]:RuntimeError: CUDA error", None, 2, "RuntimeError: CUDA error"),           # role with host
    ("[default|rank=1|local=1] [rank1]: Traceback (most recent call last):", 1, 1,
     "Traceback (most recent call last):"),                                                 # prefix template
    # a template's `[${role_name}|r${rank}] ` (sample_logs/cpu_adhoc/load_size_np16_r9_template)
    ("[default|r9] [rank9]: \tsize mismatch for 0.weight: copying a param", 9, None,
     "\tsize mismatch for 0.weight: copying a param"),
    ("[1,3]<stdout>:step 5 loss 2.1", 3, None, "step 5 loss 2.1"),                          # OpenMPI --tag-output
    ("[0]<stderr>:Killed", 0, None, "Killed"),       # horovodrun's gloo launcher (horovod/horovod#2907)
    ("[1,12]<stderr>:Traceback (most recent call last):", 12, None, "Traceback (most recent call last):"),
    # SageMaker's mpirun (aws/sagemaker-training-toolkit's test_process.py; huggingface/notebooks' sagemaker logs)
    ("[1,mpirank:10,algo-2]<stderr>:KeyError: 'labels'", 10, None, "KeyError: 'labels'"),
    ("[rank1]:", 1, None, ""),                                                              # only a prefix
    ("[rank0]:[rank0]: RuntimeError: Missing key", 0, None, "RuntimeError: Missing key"),   # doubled (torch 2.6)
    # Ray's log monitor (hiyouga/EasyR1#228; Ray Train's worker form with its node address)
    ("(Runner pid=868697) Error while creating shared memory segment /dev/shm/nccl-UmqSM9 (size 7340384)",
     None, None, "Error while creating shared memory segment /dev/shm/nccl-UmqSM9 (size 7340384)"),
    ("(RayTrainWorker pid=4121, ip=10.0.0.5) [rank1]: KeyError: 'labels'", 1, None, "KeyError: 'labels'"),
    # a vLLM worker names its rank (vllm-project/vllm#14452)
    ("(VllmWorker rank=0 pid=10672) ERROR 03-16 06:12:38 [multiproc_executor.py:375] torch.OutOfMemoryError: x", 0,
     None, "ERROR 03-16 06:12:38 [multiproc_executor.py:375] torch.OutOfMemoryError: x"),
    ("(pid=77) step 3", None, None, "step 3"),
    # a wrapper's stream tag glued to the message (pytorch/pytorch#77737)
    ("[stderr]ModuleNotFoundError: No module named 'tensorboard'", None, None,
     "ModuleNotFoundError: No module named 'tensorboard'"),
    # SkyPilot's per-node prefix (skypilot-org/skypilot#5181): the rank there numbers nodes
    ("(worker1, rank=1, pid=914, ip=10.1.145.81) bash: torchrun: command not found", None, None,
     "bash: torchrun: command not found"),
    ("(see the docs) pid=3 is not a Ray prefix", None, None, "(see the docs) pid=3 is not a Ray prefix"),
])
def test_prefix_layers(line, rank, local, text):
    p = strip_prefixes(line, PLAIN)
    assert (p.rank, p.local_rank, p.text) == (rank, local, text)


def test_srun_label_only_when_the_log_uses_it():
    sample = ["29: [rank29]: Traceback (most recent call last):", "3: step 1", "0: hello"] * 5
    dialect = Dialect.detect(sample)
    assert dialect.srun
    p = strip_prefixes("29: [rank29]: Traceback (most recent call last):", dialect)
    assert (p.rank, p.text) == (29, "Traceback (most recent call last):")
    assert strip_prefixes("3: something", PLAIN).rank is None


def test_host_prefix_only_for_hosts_the_log_uses_widely():
    sample = ["worker-1: [2025-01-16 16:17:48,379] [INFO] [launch.py:146:main] x"] * 8 + \
             ["worker-0: [Rank 0] DeepSpeed info: version=0.8.3"] * 8 + ["RuntimeError: boom"] * 8
    dialect = Dialect.detect(sample)
    assert dialect.hosts == {"worker-0", "worker-1"}
    assert strip_prefixes("worker-0: [Rank 0] DeepSpeed info", dialect).host == "worker-0"
    assert strip_prefixes("RuntimeError: boom", dialect).text == "RuntimeError: boom"


def test_programs_naming_themselves_are_not_hosts():
    # a Slurm log of failed steps (sample_logs/public7/itwinai472_*): "srun" starts most lines
    sample = ["srun: error: node01: task 0: Exited with exit code 2", "srun: Terminating StepId=6666903.0",
              "[2025-12-11T02:29:03.160] error: execve(): bash: No such file or directory"] * 5
    dialect = Dialect.detect(sample)
    assert dialect.hosts == frozenset()
    assert strip_prefixes(sample[0], dialect).text == sample[0]


def test_glued_lines_split_without_losing_text():
    for line in ["[rank 0] step 1 loss 0.1842[rank 1] step 1 loss 0.0765",
                 "    main(args)[rank1]:     main(args)",
                 "[default0]:[rank 0] step 1[default1]:[rank 1] step 1"]:
        parts = split_glued(line)
        assert len(parts) == 2 and "".join(parts) == line
    assert split_glued("[default0]:[rank0]: x") == ["[default0]:[rank0]: x"]


def test_log_collector_timestamps_only_when_the_log_uses_them():
    # `docker logs -t` / `kubectl logs --timestamps` / Beaker (sample_logs/public4/ace120_*)
    lines = ["2023-05-26T16:48:07.093268664Z Traceback (most recent call last):",
             "2023-05-26T16:48:07.093293614Z   File \"train.py\", line 840, in <module>",
             "2023-05-26T16:48:07.093439184Z [rank1]: KeyError: 'target'"]
    dialect = Dialect.detect(lines)
    assert dialect.stamped
    assert strip_prefixes(lines[0], dialect).text == "Traceback (most recent call last):"
    third = strip_prefixes(lines[2], dialect)
    assert (third.text, third.rank) == ("KeyError: 'target'", 1)
    once = "2023-05-26T16:48:07Z started"
    assert not Dialect.detect([once, "plain line", "another"]).stamped
    assert strip_prefixes(once, PLAIN).text == once


def test_a_collector_stamp_closed_by_a_colon_is_stripped_before_the_mpi_tag():
    # sample_logs/public23/deit76_*: a job service's console, `<ISO time>: [1,0]<stderr>:...`
    lines = ["2021-03-10T13:22:37.443Z: [1,0]<stderr>:    raise self.exc_type(msg)",
             "2021-03-10T13:22:37.443Z: [1,0]<stderr>:OSError: Caught OSError in DataLoader worker process 3.",
             "2021-03-10T13:22:37.443Z: [1,0]<stderr>:Original Traceback (most recent call last):"]
    dialect = Dialect.detect(lines)
    second = strip_prefixes(lines[1], dialect)
    assert dialect.stamped
    assert (second.text, second.rank) == ("OSError: Caught OSError in DataLoader worker process 3.", 0)


# Labels a console or a paste puts on every line, as (the Dialect flag, lines of a real log, each
# line's text after the label, rank of the last line, a sample that must not set the flag).
EVERY_LINE_LABELS = [
    # CircleCI as pasted in pytorch/pytorch#48500 (sample_logs/public38/pytorch48500_*), syslog alike
    ("clock_stamped",
     ["Nov 26 23:08:31 Traceback (most recent call last):",
      'Nov 26 23:08:31   File "common_distributed.py", line 278, in wrapper',
      "Nov  6 23:08:31 [rank1]: AssertionError: False is not true : Expected zero exit code but got -11"],
     ["Traceback (most recent call last):", '  File "common_distributed.py", line 278, in wrapper',
      "AssertionError: False is not true : Expected zero exit code but got -11"], 1,
     ["Nov 26 23:08:31 started", "plain line", "another"]),
    # a Kaggle notebook's log (sample_logs/public37/f5tts_kaggle_*): elapsed time and line number
    ("clock_stamped",
     ["704.7s\t1290\tTraceback (most recent call last):", "704.7s\t1295\tRuntimeError: x", "705.1s\t1296\tdone"],
     ["Traceback (most recent call last):", "RuntimeError: x", "done"], None,
     ["704.7s\t1290\tstarted", "plain line", "another"]),
    # journald/syslog with the host and the program's tag, docker compose's label
    ("clock_stamped",
     ["May 01 10:00:01 node01 python[1234]: [rank2]: Traceback (most recent call last):",
      "May 01 10:00:01 node01 python[1234]: [rank2]: KeyError: 'target'"],
     ["Traceback (most recent call last):", "KeyError: 'target'"], 2, ["plain", "another"]),
    ("clock_stamped",
     ["trainer-1  | [rank2]: Traceback (most recent call last):", "trainer-1  | [rank2]: KeyError: 'target'"],
     ["Traceback (most recent call last):", "KeyError: 'target'"], 2, ["plain | pipe", "another"]),
    # nv-morpheus/Morpheus#1021 (sample_logs/public39/morpheus_1021_*): spawn's error under pytest;
    # the indent under the `E` stays
    ("pytest",
     ["E       -- Process 0 terminated with the following error:",
      "E       Traceback (most recent call last):",
      'E         File "multiprocessing.py", line 30, in _wrap',
      "E       AssertionError"],
     ["-- Process 0 terminated with the following error:", "Traceback (most recent call last):",
      '  File "multiprocessing.py", line 30, in _wrap', "AssertionError"], None,
     ["E0424 01:11:21.160832 1 x.cpp:1] error", "plain"]),
    # sample_logs/public43/songnet_20_*: every line of the paste starts with `> `
    ("quoted",
     ['> label_smoothing.py", line 15, in __init__',
      "> self.one_hot = torch.full((1, size), self.smoothing_value).to(device)",
      "> RuntimeError: CUDA error: invalid device ordinal"],
     ['label_smoothing.py", line 15, in __init__',
      "self.one_hot = torch.full((1, size), self.smoothing_value).to(device)",
      "RuntimeError: CUDA error: invalid device ordinal"], None,
     ["> one quoted line", "plain", "another plain"]),
    # sample_logs/public78/moe_autotp_*: the run's output pasted below a script as comments; the
    # indent of a traceback's frame stays
    ("quoted",
     ["# Traceback (most recent call last):", '#   File "/root/fix.py", line 47, in <module>',
      "# [rank1]: TypeError: generate() argument after ** must be a mapping, not Tensor"],
     ["Traceback (most recent call last):", '  File "/root/fix.py", line 47, in <module>',
      "TypeError: generate() argument after ** must be a mapping, not Tensor"], 1,
     ["#0  0x00007f3c in raise () from libc.so.6", "#1  0x00007f3d in abort () from libc.so.6", "plain"]),
]


@pytest.mark.parametrize("flag, lines, texts, last_rank, not_it", EVERY_LINE_LABELS)
def test_a_label_on_every_line_is_stripped_only_where_the_log_uses_it(flag, lines, texts, last_rank, not_it):
    dialect = Dialect.detect(lines)
    assert getattr(dialect, flag) and not dialect.stamped
    assert [strip_prefixes(line, dialect).text for line in lines] == texts
    assert strip_prefixes(lines[-1], dialect).rank == last_rank
    assert not getattr(Dialect.detect(not_it), flag)


def test_a_paste_indented_as_a_code_block_is_read_without_its_indent():
    # sample_logs/public16/dgl7426_*: every line of the paste starts with four spaces
    sample = ["    Traceback (most recent call last):",
              '      File "/graphstorm/run.py", line 190, in <module>',
              "    torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1333, invalid usage",
              "    Last error:"]
    dialect = Dialect.detect(sample)
    assert dialect.indent == 4
    assert strip_prefixes(sample[2], dialect).text.startswith("torch.distributed.DistBackendError: NCCL error")
    assert strip_prefixes(sample[1], dialect).text == '  File "/graphstorm/run.py", line 190, in <module>'
    assert Dialect.detect(["step 1", "    indented", "step 2"]).indent == 0
    # a one- or two-line paste is read without its indent too
    assert Dialect.detect(["    AttributeError: 'DistributedDataParallel' object has no attribute 'config'"]).indent == 4


def test_a_code_fence_or_a_tab_indent_does_not_hide_the_paste_conventions():
    # sample_logs/public10/ds2899_*, pasted between Markdown fences and indented by a tab
    sample = ["```bash",
              "\tnode01: ret = input.softmax(dim, dtype=dtype)",
              "\tnode01:     ret = input.softmax(dim, dtype=dtype)",
              "\tnode01: torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 896.00 MiB (GPU 2; ...)",
              "```"]
    dialect = Dialect.detect(sample)
    assert dialect.indent == 1 and dialect.hosts == frozenset({"node01"})
    assert strip_prefixes(sample[3], dialect).text.startswith("torch.cuda.OutOfMemoryError: CUDA out of memory")


def test_a_short_paste_with_a_node_name_on_every_line_reads_it_as_a_host():
    # sample_logs/public10/ds2899_*: three lines, all `node01: `, too few for the usual floor
    sample = ["node01: ret = input.softmax(dim, dtype=dtype)",
              "node01:     ret = input.softmax(dim, dtype=dtype)",
              "node01: torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 896.00 MiB"]
    dialect = Dialect.detect(sample)
    assert dialect.hosts == {"node01"}
    p = strip_prefixes(sample[2], dialect)
    assert (p.host, p.text) == ("node01", "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 896.00 MiB")
    # plain words before a colon (a config dump) are not node names
    assert Dialect.detect(["model: llama", "lr: 0.1", "epochs: 3"]).hosts == frozenset()


def test_a_script_naming_itself_on_every_rank_is_not_a_host():
    # sample_logs/public81/dualstylegan_*: eight ranks' argparse error, `finetune_stylegan.py: error: ...`
    sample = ["usage: finetune_stylegan.py [-h] [--iter ITER] [--batch BATCH]",
              "finetune_stylegan.py: error: the following arguments are required: path"] * 8
    dialect = Dialect.detect(sample)
    assert dialect.hosts == frozenset()
    assert strip_prefixes(sample[1], dialect).text == sample[1]


def test_launcher_labels_stay_on_every_glued_piece():
    # pdsh labels a host's every line: both ranks' output glued on it are that host's
    # (sample_logs/cpu_matrix/*pdsh_nodes_tee3*); an MPI tag before a torch prefix is one piece
    from logtriage.demux.line_marks import pieces_of
    line = "worker-1: [default1]:[rank 4] step 3 loss nan[default0]:[rank 3] step 3 loss 0.2"
    dialect = Dialect.detect([line] * 6)
    assert pieces_of(line, dialect) == ["worker-1: [default1]:[rank 4] step 3 loss nan",
                                        "worker-1: [default0]:[rank 3] step 3 loss 0.2"]
    assert pieces_of("[1,0]<stdout>:[rank0]: Traceback (most recent call last):", PLAIN) == [
        "[1,0]<stdout>:[rank0]: Traceback (most recent call last):"]


def test_a_supervisors_constant_tag_on_most_lines_is_stripped_but_a_log_level_is_not():
    # sample_logs/public46/genetictrading_supervisor_*: a supervisor script tags its torchrun child's lines
    sample = ["[TRAINING] [rank0]: Traceback (most recent call last):",
              '[TRAINING] [rank0]:   File "/work/main.py", line 679, in <module>',
              "[TRAINING] [rank0]: TypeError: run_ga_evolution() got an unexpected keyword argument 'elite_count'",
              "INFO:__main__:Starting the training process"]
    dialect = Dialect.detect(sample)
    assert dialect.wrapper_tag == "TRAINING"
    parsed = strip_prefixes(sample[2], dialect)
    assert (parsed.rank, parsed.text) == (0, "TypeError: run_ga_evolution() got an unexpected keyword argument 'elite_count'")
    assert Dialect.detect(["[INFO] step 1", "[INFO] step 2", "[INFO] step 3"]).wrapper_tag == ""
    assert Dialect.detect(["[TRAINING] step 1", "step 2", "step 3"]).wrapper_tag == ""
    # `kubectl logs --prefix`: the pod and container on every line
    pod = ["[pod/train-worker-0/pytorch] [rank1]: Traceback (most recent call last):",
           "[pod/train-worker-0/pytorch] [rank1]: KeyError: 'target'"]
    dialect = Dialect.detect(pod)
    assert dialect.wrapper_tag == "pod/train-worker-0/pytorch"
    assert (strip_prefixes(pod[1], dialect).rank, strip_prefixes(pod[1], dialect).text) == (1, "KeyError: 'target'")


@pytest.mark.parametrize("number", ["{:>4} | ", "{}: ", "{}:", "{}\t"])
def test_a_line_number_gutter_is_stripped_and_is_no_srun_label(number):
    # a log viewer's or an editor's line numbers (`  26 | `, `26: `): they rise by one and never
    # come round again, where srun's task labels do (docs/research/gaps42.md)
    body = ["[rank2]: Traceback (most recent call last):", '[rank2]:   File "train.py", line 3, in <module>',
            "[rank2]: KeyError: 'target'", "[rank0]: step 3 loss 0.5"] * 3
    lines = [number.format(n) + line for n, line in enumerate(body, start=24)]
    dialect = Dialect.detect(lines)
    assert dialect.gutter and not dialect.srun
    third = strip_prefixes(lines[2], dialect)
    assert (third.rank, third.text) == (2, "KeyError: 'target'")
    short = [f"{n:>4} | {line}" for n, line in enumerate(body[:4], start=1)]   # a bar: no srun label, even short
    assert Dialect.detect(short).gutter
    turns = [f"{r}: step {s} loss 0.5" for s in range(4) for r in range(4)]
    srun = Dialect.detect(turns)
    assert srun.srun and not srun.gutter
    assert strip_prefixes(turns[5], srun).rank == 1


def test_other_envelopes_of_pasted_logs():
    # CloudWatch's export (a TAB after the time), docker-compose v1's `name_1  | `, a quote's quote
    stamped = [f"2024-05-01T10:00:0{n}.000Z\t[rank1]: KeyError: 'target'" for n in range(3)]
    assert strip_prefixes(stamped[0], Dialect.detect(stamped)).rank == 1
    compose = [f"trainer_1  | [rank{n}]: step 1" for n in range(4)]
    assert strip_prefixes(compose[3], Dialect.detect(compose)).text == "step 1"
    nested = ["> > [rank3]: Traceback (most recent call last):", "> > [rank3]: KeyError: 'x'", ">> [rank0]: step 1"]
    dialect = Dialect.detect(nested)
    assert [strip_prefixes(line, dialect).rank for line in nested] == [3, 3, 0]


def test_a_templates_word_and_number_label_names_the_rank_where_the_log_uses_it_widely():
    # TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[r${rank}] ' (cpu_adhoc nan_spread_np7_r5_template)
    lines = [f"[r{r}] rank {r} step 3 local loss 0.5" for r in range(4)] + ["[r1] [rank1]: FloatingPointError: nan"]
    dialect = Dialect.detect(lines)
    assert dialect.bracket_label == "r"
    assert [strip_prefixes(line, dialect).rank for line in lines] == [0, 1, 2, 3, 1]
    assert strip_prefixes(lines[2], dialect).text == "rank 2 step 3 local loss 0.5"
    worker = Dialect.detect([f"[worker{r}] step 1" for r in range(3)])
    assert strip_prefixes("[worker2] step 1", worker).local_rank == 2
    # `'[${role_name}-${local_rank}] '` (cpu_adhoc lf_zerodiv_np5_r2_prefixrole): a hyphen between them
    hyphen = Dialect.detect([f"[worker-{r}] rank {r}: building model" for r in range(5)])
    assert strip_prefixes("[worker-2] [rank2]: ZeroDivisionError: division by zero", hyphen).local_rank == 2
    assert Dialect.detect([f"[epoch-{e}] loss 0.5" for e in range(4)]).bracket_label is None
    # once in a log is no convention: a list index stays text; nor is a loop's counter
    assert Dialect.detect(["[1] first item", "plain", "another", "more"]).bracket_label is None
    assert Dialect.detect([f"[epoch{e}] loss 0.5" for e in range(4)]).bracket_label is None


def test_a_bracketed_label_that_torchs_own_rank_label_belies_is_a_nodes():
    # two agents' consoles through `sed 's/^/[nodeK] /'` (cpu_adhoc twon_segv_np4_r3_pdsh2): `[node1] [rank3]: `
    lines = ([f"[node{k}] W1205 00:31:31.959000 13170 torch/distributed/run.py:874] " for k in (0, 1)] * 3
             + [f"[node{r // 2}] [rank{r}]: RuntimeError: Connection closed by peer" for r in range(4)] * 2)
    dialect = Dialect.detect(lines)
    assert (dialect.bracket_label, dialect.bracket_hosts, dialect.hosts) == (None, True, {"node0", "node1"})
    p = strip_prefixes("[node1] [rank3]: RuntimeError: Connection closed by peer", dialect)
    assert (p.host, p.rank, p.text) == ("node1", 3, "RuntimeError: Connection closed by peer")


def test_local_ranks_that_are_not_global_ranks_are_scoped_only_where_the_log_shows_it():
    # --tee's `[default2]:` is a local rank; on a second node's console (sample_logs/cpu_adhoc/
    # sigbus_np8_r6_srun2, node 1) its traceback lines say `[default3]:[rank7]:`, its summary
    # `rank      : 6 (local_rank: 2)`: such a log is read by the exact path, console by console
    one_node = ["[default0]:step 1", "[default1]:[rank1]: Traceback (most recent call last):",
                "  rank      : 1 (local_rank: 1)"]
    assert not Dialect.detect(one_node).local_scoped
    assert Dialect.detect(one_node + ["[default3]:[rank7]: Traceback (most recent call last):"]).local_scoped
    summary = Dialect.detect(["[default2]:Fatal Python error: Bus error", "  rank      : 6 (local_rank: 2)"])
    assert summary.local_scoped and summary.exact_only
    # with host labels the host scopes them already
    hosts = Dialect.detect(["worker-1: [default3]:[rank7]: boom"] * 6)
    assert hosts.hosts and not hosts.local_scoped


def test_a_hard_wrap_is_seen_only_where_the_longest_lines_are_many_and_different():
    from logtriage.demux.wrapped import RowJoiner, wrap_width
    log = open("sample_logs/cpu/rank_sigkill__np4.log", encoding="utf-8").read().splitlines()
    rows = [line[i:i + 120] for line in log for i in range(0, len(line), 120)]
    assert Dialect.detect(rows).wrap_width == 120 and Dialect.detect(rows).exact_only
    assert Dialect.detect(log).wrap_width == 0
    # ranks repeating one long line (same text, other numbers) are no wrap
    same = [f"[rank{r}]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] "
            "Connection closed by peer" for r in range(4)] + ["step 1", "step 2"]
    assert wrap_width(same, Dialect().labelled) == 0
    joiner = RowJoiner(10, Dialect().labelled)
    out = joiner.push(1, 0, "[rank1]: K") + joiner.push(2, 11, "eyError: 'target'") + joiner.push(3, 29, "[rank2]: s")
    out += joiner.push(4, 40, "[rank3]: step 2") + joiner.flush()
    assert out == [((1, 2), (0, 11), "[rank1]: KeyError: 'target'"), ((3,), (29,), "[rank2]: s"),
                   ((4,), (40,), "[rank3]: step 2")]


def test_kubectl_prefix_names_the_pod_as_a_node():
    # `kubectl logs -l job=train --prefix` (kubectl >= 1.17): `[pod/<pod>/<container>] ` on every line
    sample = [f"[pod/train-worker-{n}/pytorch] [default{r}]:step 1 loss 0.5" for n in range(2) for r in range(4)]
    dialect = Dialect.detect(sample)
    assert dialect.pods and not dialect.local_scoped
    p = strip_prefixes("[pod/train-worker-1/pytorch] [default2]:KeyError: 'labels'", dialect)
    assert (p.host, p.local_rank, p.rank, p.text) == ("train-worker-1", 2, None, "KeyError: 'labels'")
    # one pod alone is a wrapper's tag, as before
    assert not Dialect.detect(["[pod/train-0/pytorch] step 1"] * 5).pods


def test_rich_logging_layout_reads_from_the_level_and_drops_the_gutter():
    # rich's RichHandler under --tee 3 (sample_logs/cpu_adhoc/logexc_exit_np6_r0_tee): time and level
    # columns, the caller's path at the right, wrapped rows under a blank gutter of 29 columns
    rows = ["[default0]:[12/02/26 11:55:07] ERROR    [rank 0] training failed             fault29.py:180",
            "[default0]:                             Traceback (most recent call last):                 ",
            "[default0]:                               File \"/tmp/job/fault29.py\",                  ",
            "[default1]:                    INFO     step 2 loss 0.61                   fault29.py:170",
            "[default0]:                             ValueError: could not convert string               ",
            "[default2]:[12/02/26 11:55:08] WARNING  slow step                          fault29.py:172"]
    dialect = Dialect.detect(rows)
    assert dialect.rich_gutter == 29 and dialect.exact_only
    texts = [strip_prefixes(row, dialect).text for row in rows]
    assert texts == ["ERROR    [rank 0] training failed", "Traceback (most recent call last):",
                     "  File \"/tmp/job/fault29.py\",", "INFO     step 2 loss 0.61",
                     "ValueError: could not convert string", "WARNING  slow step"]
    # two records are not a layout; a plain indented line is left as it is
    assert Dialect.detect(rows[:2]).rich_gutter == 0
