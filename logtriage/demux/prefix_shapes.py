"""The shapes of the labels launchers, collectors and pastes put in front of a log's lines (see
demux/prefixes.py for the order they are stripped in), and the test of a row that carries one."""

from __future__ import annotations

import re

SRUN = re.compile(r"^ {0,6}(\d{1,7}): ")
COLLECTOR_STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,9})?(?:Z|[+-]\d\d:?\d\d):?[ \t]")
# a log viewer's or an editor's line numbers in front of each line (`  12 | `, `12: `, `12:`, `12\t`)
GUTTER = re.compile(r"^ {0,6}(\d{1,7})(?: ?\| |:(?! )|: |\t)")
# a CI console's or syslog's clock (`Nov 26 23:08:31 `, with syslog's host and `tag[pid]: `), a Kaggle
# notebook log's elapsed time and line number (`704.7s\t1290\t`), or docker compose's container label
# (`trainer-1  | `). (A full date and time, `[2025-06-03 16:12:09] ` or a logging stamp, stays: the
# analysis orders evidence by it.)
CLOCK_STAMP = re.compile(r"^(?:(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) [ \d]\d \d\d:\d\d:\d\d(?:\.\d{1,9})? "
                          r"(?:[A-Za-z0-9][\w.-]{0,62} [\w./-]{1,40}\[\d{1,9}\]: )?"   # syslog's host and tag[pid]
                          r"|\d{1,7}\.\d{1,3}s\t\d{1,9}\t"
                          r"|[a-z0-9][\w.-]{0,62}[-_]\d{1,4} +\| )")
# a quote's or a comment's mark: `> ` (Markdown) or `# ` (output pasted into a script below its code)
QUOTE_MARKS = (">", "#")   # `#` only before a blank or the line's end: gdb's `#0  0x...` frames are not comments
# a supervisor's constant tag in front of its child's output (`[TRAINING] [rank0]: ...`): a word, no digits
# (or `kubectl logs --prefix`'s `[pod/<pod>/<container>] `)
WRAPPER_TAG = re.compile(r"^\[([A-Za-z][A-Za-z_ .-]{1,30}|pod/[\w.-]{1,253}/[\w.-]{1,63})\] ")
# `kubectl logs --prefix` over several pods (a PyTorchJob's master and workers): `[pod/<pod>/<container>] `;
# the pod is a node (one torchrun each), its container's lines keep their own rank labels after it
KUBECTL = re.compile(r"^\[pod/([A-Za-z0-9][\w.-]{0,252})/[\w.-]{1,63}\] ")
# rich's logging handler (`RichHandler`) lays each record out in columns: the time (`[12/02/26 11:55:07]`,
# blank when it repeats), the level padded to 8, the message word-wrapped to the console's width, and the
# caller's `file.py:NNN` at the right of the first row; the rows a record wraps onto keep the first two
# columns blank. The message column is the gutter's width.
RICH_HEAD = re.compile(r"^(?:\[[^\[\]\n]{4,40}\]| {4,40}) "
                        r"(?P<level>(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) {1,8})(?=\S)")
RICH_PATH = re.compile(r" {2,}[\w.<>-]{1,80}:\d{1,6} *$")
NOT_TAGS = frozenset("info warn warning error err debug critical fatal trace notice stdout stderr".split())
PYTEST_E = re.compile(r"^E {3}(?: {4})?")
PYTEST_EXCEPTION = re.compile(r"^E {3}(?: {4})?(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception): ")
# Open MPI's `[job,rank]<stderr>:`; horovodrun's own (gloo) launcher writes `[rank]<stderr>:`; SageMaker's
# mpirun names the rank and the host: `[1,mpirank:5,algo-2]<stderr>:` (aws/sagemaker-training-toolkit)
MPI = re.compile(r"^\[(?:(\d{1,9}),)?(?:mpirank:)?(\d{1,12})(?:,[\w.-]{1,64})?\]<(?:stdout|stderr|stddiag)>: ?")
HOST = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]{0,62}): ")
# a node's label in brackets from a wrapper's `sed 's/^/[node1] /'` (told from a template's `[r1] ` rank
# label by torch's own `[rankN]: ` after it naming other ranks)
BRACKET_HOST = re.compile(r"^\[([A-Za-z][A-Za-z0-9_.-]{0,62})\] ")
# a Ray worker `(RayTrainWorker pid=1234, ip=...)`, a vLLM worker `(VllmWorker rank=0 pid=10672)`, and
# newer vLLM's `(VllmWorker TP1 pid=N)` and `(Worker_TP1 pid=N)` (its tensor-parallel rank: the rank
# where tensor parallelism is the only one; `Worker_PP0_TP1` and `EngineCore_DP1` name no world
# rank), or SkyPilot's `(worker1, rank=1, pid=914, ip=...)` (a node's number)
RAY = re.compile(r"^\((?:(?:Worker_TP(\d{1,9})|[A-Za-z_][\w.-]{0,60}) (?:rank=(\d{1,9}) |TP(\d{1,9}) )?"
                  r"|[\w.-]{1,60}, rank=(\d{1,9}), )?pid=\d{1,9}(?:, ip=[0-9A-Fa-f.:]{3,45})?\) ")
# vLLM's own multiprocessing executor labels its processes the same way; its workers share one
# node's GPUs (worker k on cuda:k), unlike Ray's, which each see one GPU as cuda:0
VLLM_PROCESS = re.compile(r"^\((?:VllmWorker|Worker(?:_[A-Z]+\d+)*|EngineCore(?:_DP\d+)?|APIServer)"
                           r"(?: rank=\d+| TP\d+)? pid=\d+\) ")
STREAM_TAG = re.compile(r"^\[std(?:out|err)\] ?")
TEE = re.compile(r"^\[([A-Za-z_][A-Za-z_-]*?)(\d{1,7})\]:")
# a role named in any script (`--role 训练器` gives `[训练器3]:`); the fast kernel sends such lines to the exact path
TEE_WIDE = re.compile(r"^\[([^\W\d](?:[^\W\d]|-)*?)(\d{1,7})\]:")
TEE_HOST = re.compile(r"^\[([A-Za-z0-9][A-Za-z0-9_.-]*):(\d{1,7})\]:")
EXCEPTHOOK = re.compile(r"^\[rank(\d{1,12})\]:(?: |(?=\[)|$)")
# (its label may have no space after it: `TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[${role_name}|r${rank}]'` puts
# the message right after it, `[default|r0][rank0]: Traceback ...`)
TEMPLATE = re.compile(r"^\[([^\[\]\n]{1,120})\](?::? |:?(?=\S))")
# (a field of its own: `rank=1`, `rank 1`, `rank1`, or `r1` as in `[${role_name}|r${rank}] ` and
# `[${role_name}-r${rank}/l${local_rank}]:`)
TEMPLATE_RANK = re.compile(r"(?:^|[|,;\s/-])(?:global_)?(?:rank|r)[=:\s]?(\d{1,12})(?:$|[|,;\s/])", re.IGNORECASE)
# a trainer's own rank label in front of the lines it writes (SimpleTuner: `[RANK 1] 2026-05-19 ...`; a
# logging format's `[rank=2] `, `[rank: 2] `, `[Rank 2] `); torch's excepthook `[rank2]:` is not this
# (`[rank 2] ` and `[Rank 2] ` are a user's rank marker, read as such by the demuxer and the fast scan alike)
RANK_LABEL = re.compile(r"^\[(?:[Rr][Aa][Nn][Kk][=:] ?|RANK )(\d{1,9})\]:? ")
# a hand-made launcher's `sed "s/^/[rank $R] /"` label: stripped only in front of torch's own `[rank2]: `
SPACED_RANK_LABEL = re.compile(r"\[[Rr]ank (\d{1,9})\] ")
# a line-prefix template's own label (`TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[r${rank}] '`): one short
# word (or none) and the rank; global for `r`/`rank` or no word, else the role's local rank, as --tee's;
# a hyphen may stand between them (`'[${role_name}-${local_rank}] '`: `[worker-2] `)
BRACKET_LABEL = re.compile(r"^\[([A-Za-z_]{0,12})-?(\d{1,7})\] ")
GLOBAL_WORDS = frozenset({"", "r", "rank"})
# a loop's own counters in brackets (`[epoch3] `, `[step120] `) are no rank label
COUNTER_WORDS = frozenset("epoch ep e iter iteration it i step s batch b t loss round".split())
# a template's field naming the role and the global rank glued (`${role_name}${rank}`: `[default1|1]:` from
# `'[${role_name}${rank}|${local_rank}]:'`), as the tee header names the role and the local rank
TEMPLATE_ROLE_RANK = re.compile(r"[A-Za-z_][A-Za-z_-]*?(\d{1,7})")
TEMPLATE_LOCAL = re.compile(r"(?:local(?:_rank)?[=:\s]?|(?<=[|,;\s/-])l)(\d{1,7})(?![\w])", re.IGNORECASE)
MAX_INDENT = 8
# a Markdown code fence around (or between parts of) a pasted log: not part of the log's conventions
FENCE = re.compile(r"^\s*(?:```|~~~)[\w+.-]*\s*$")
NOT_HOSTS = frozenset(
    "traceback file note warning warnings error info debug critical fatal exception failures time host rank "
    "exitcode error_file traceback root cause reason message http https std stdout stderr usage hint "
    "what caused step epoch loss iteration args kwargs key value none true false "
    # programs that name themselves before their message (`srun: error: node01: task 0: ...`)
    "srun slurmstepd sbatch salloc scontrol mpirun mpiexec orterun prterun bash sh python python3 "
    "torchrun deepspeed accelerate pdsh ssh".split())
EXCEPTION_NAME = re.compile(r"(?:Error|Exception|Warning|Interrupt|Exit|Failure|Fault)$")
# a program or source file that names itself before its message (argparse's `train.py: error: ...`,
# `ProcessGroupNCCL.cpp: ...`), however many ranks repeat it
SOURCE_FILE = re.compile(
    r"\.(?:py|pyx|sh|c|cc|cpp|cu|cuh|h|hpp|rs|go|java|js|ts|lua|pl|rb|jl|yaml|yml|json|toml|txt|log)$", re.IGNORECASE)


def labelled(row: str, srun: bool) -> bool:
    """Whether a row starts with a rank's, a tee's, Open MPI's or (where the log uses them) srun's label."""
    return bool(TEE.match(row) or TEE_HOST.match(row) or EXCEPTHOOK.match(row) or MPI.match(row)
                or (srun and SRUN.match(row)))


def is_quoted(line: str, mark: str) -> bool:
    """The line starts with the quote mark (`#` only as a comment's: before a blank or the end)."""
    return line.startswith(mark) and (mark == ">" or line[len(mark):len(mark) + 1] in ("", " "))


def unquote(line: str, mark: str) -> str:
    """The line without its quote mark and one blank after it (a quote's quote's marks too:
    `> > `, `>> `)."""
    text = line[len(mark):] if line.startswith(mark) else line
    text = text[1:] if text.startswith(" ") else text
    if mark == ">":
        while text.startswith(">"):
            text = text[2:] if text.startswith("> ") else text[1:]
    return text
