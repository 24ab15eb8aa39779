"""Launcher prefixes, outermost first, each stripped once:

    paste indentation   every line indented alike (a log pasted as a Markdown code block)
    Markdown quote      `> ` before every line (a log pasted as a quote; likewise; a quote in a
                        quote, `> > `, too), or `# ` (a log pasted as comments into a script)
    line-number gutter  `  12 | `, `12: `, `12:`, `12<TAB>` (a log viewer's or an editor's line numbers,
                        rising by one from line to line; only when the log uses it widely)
    collector stamp     `2023-05-26T16:48:07.093268664Z ` or `...Z: ` or `...Z<TAB>`  (docker logs -t, kubectl logs
                                                   --timestamps, job-service consoles;
                                                   only when the log uses it widely)
                        `Nov 26 23:08:31 `        (a CI console's or syslog's clock, no year, or a Kaggle
                        `704.7s<TAB>1290<TAB>`     notebook log's time and line, or docker
                        `trainer-1  | `            compose's container label; likewise)
    wrapper tag         `[TRAINING] `             (a supervisor script's constant tag; only when the log
                                                   uses it on most lines)
    pytest report       `E       `                (the failure text of a test, `--tb=long`; `E   ` short;
                                                   when the log shows it on two lines or more)
    srun --label        `3: `                     (the task: a rank, or a node when each task runs torchrun;
                                                   only when the log uses it widely)
    OpenMPI tag-output  `[1,3]<stdout>:`          (global rank; horovodrun's gloo launcher: `[3]<stdout>:`;
                                                   SageMaker's `[1,mpirank:3,algo-1]<stdout>:`)
    pdsh / DeepSpeed    `worker-3: `              (host; only for hosts the log uses widely)
    Ray log monitor     `(RayTrainWorker pid=1234, ip=10.0.0.5) `   (a Ray worker process; no rank)
                        vLLM's `(VllmWorker rank=0 pid=10672) `     (a vLLM worker: its rank)
                        and SkyPilot's `(worker1, rank=1, pid=914, ip=10.1.145.81) ` (a node's rank)
    stream tag          `[stderr]` `[stdout]` (a wrapper's, glued to the message; no rank)
    torchrun --tee      `[default0]:` `[trainer1]:` `[gpu187:2]:`   (local rank)
    prefix template     `[default|rank=1|local=1] ` or any leading `[...]` with a rank field;
                        a trainer's `[RANK 1] ` label; a template's `[r1] ` / `[w1] ` (a word and a
                        number in brackets, the same word on many lines of the log)
    excepthook          `[rank1]: `               (global rank)
    C++ log rank        `[rank1]:[I1130 ...`      (global rank; the glog header stays in the text)

Ambiguous shapes (`3: `, `host: `) count only when a sample of the log shows them as a
convention (see Dialect), so `RuntimeError: ...` is never taken for a host.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable

from logtriage.demux.around_paste import environment_report_span
from logtriage.demux.launcher import CFE_RANK
from logtriage.demux.clean import after_bar
from logtriage.demux.wrapped import wrap_width

_SRUN = re.compile(r"^ {0,6}(\d{1,7}): ")
_COLLECTOR_STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,9})?(?:Z|[+-]\d\d:?\d\d):?[ \t]")
# a log viewer's or an editor's line numbers in front of each line (`  12 | `, `12: `, `12:`, `12\t`)
_GUTTER = re.compile(r"^ {0,6}(\d{1,7})(?: ?\| |:(?! )|: |\t)")
# a CI console's or syslog's clock (`Nov 26 23:08:31 `, with syslog's host and `tag[pid]: `), a Kaggle
# notebook log's elapsed time and line number (`704.7s\t1290\t`), or docker compose's container label
# (`trainer-1  | `). (A full date and time, `[2025-06-03 16:12:09] ` or a logging stamp, stays: the
# analysis orders evidence by it.)
_CLOCK_STAMP = re.compile(r"^(?:(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) [ \d]\d \d\d:\d\d:\d\d(?:\.\d{1,9})? "
                          r"(?:[A-Za-z0-9][\w.-]{0,62} [\w./-]{1,40}\[\d{1,9}\]: )?"   # syslog's host and tag[pid]
                          r"|\d{1,7}\.\d{1,3}s\t\d{1,9}\t"
                          r"|[a-z0-9][\w.-]{0,62}[-_]\d{1,4} +\| )")
# a quote's or a comment's mark: `> ` (Markdown) or `# ` (output pasted into a script below its code)
_QUOTE_MARKS = (">", "#")   # `#` only before a blank or the line's end: gdb's `#0  0x...` frames are not comments
# a supervisor's constant tag in front of its child's output (`[TRAINING] [rank0]: ...`): a word, no digits
# (or `kubectl logs --prefix`'s `[pod/<pod>/<container>] `)
_WRAPPER_TAG = re.compile(r"^\[([A-Za-z][A-Za-z_ .-]{1,30}|pod/[\w.-]{1,253}/[\w.-]{1,63})\] ")
# `kubectl logs --prefix` over several pods (a PyTorchJob's master and workers): `[pod/<pod>/<container>] `;
# the pod is a node (one torchrun each), its container's lines keep their own rank labels after it
_KUBECTL = re.compile(r"^\[pod/([A-Za-z0-9][\w.-]{0,252})/[\w.-]{1,63}\] ")
# rich's logging handler (`RichHandler`) lays each record out in columns: the time (`[12/02/26 11:55:07]`,
# blank when it repeats), the level padded to 8, the message word-wrapped to the console's width, and the
# caller's `file.py:NNN` at the right of the first row; the rows a record wraps onto keep the first two
# columns blank. The message column is the gutter's width.
_RICH_HEAD = re.compile(r"^(?:\[[^\[\]\n]{4,40}\]| {4,40}) "
                        r"(?P<level>(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) {1,8})(?=\S)")
_RICH_PATH = re.compile(r" {2,}[\w.<>-]{1,80}:\d{1,6} *$")
_NOT_TAGS = frozenset("info warn warning error err debug critical fatal trace notice stdout stderr".split())
_PYTEST_E = re.compile(r"^E {3}(?: {4})?")
_PYTEST_EXCEPTION = re.compile(r"^E {3}(?: {4})?(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception): ")
# Open MPI's `[job,rank]<stderr>:`; horovodrun's own (gloo) launcher writes `[rank]<stderr>:`; SageMaker's
# mpirun names the rank and the host: `[1,mpirank:5,algo-2]<stderr>:` (aws/sagemaker-training-toolkit)
_MPI = re.compile(r"^\[(?:(\d{1,9}),)?(?:mpirank:)?(\d{1,12})(?:,[\w.-]{1,64})?\]<(?:stdout|stderr|stddiag)>: ?")
_HOST = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]{0,62}): ")
# a Ray worker `(RayTrainWorker pid=1234, ip=...)`, a vLLM worker `(VllmWorker rank=0 pid=10672)`, and
# newer vLLM's `(VllmWorker TP1 pid=N)` and `(Worker_TP1 pid=N)` (its tensor-parallel rank: the rank
# where tensor parallelism is the only one; `Worker_PP0_TP1` and `EngineCore_DP1` name no world
# rank), or SkyPilot's `(worker1, rank=1, pid=914, ip=...)` (a node's number)
_RAY = re.compile(r"^\((?:(?:Worker_TP(\d{1,9})|[A-Za-z_][\w.-]{0,60}) (?:rank=(\d{1,9}) |TP(\d{1,9}) )?"
                  r"|[\w.-]{1,60}, rank=(\d{1,9}), )?pid=\d{1,9}(?:, ip=[0-9A-Fa-f.:]{3,45})?\) ")
# vLLM's own multiprocessing executor labels its processes the same way; its workers share one
# node's GPUs (worker k on cuda:k), unlike Ray's, which each see one GPU as cuda:0
_VLLM_PROCESS = re.compile(r"^\((?:VllmWorker|Worker(?:_[A-Z]+\d+)*|EngineCore(?:_DP\d+)?|APIServer)"
                           r"(?: rank=\d+| TP\d+)? pid=\d+\) ")
_STREAM_TAG = re.compile(r"^\[std(?:out|err)\] ?")
_TEE = re.compile(r"^\[([A-Za-z_][A-Za-z_-]*?)(\d{1,7})\]:")
_TEE_HOST = re.compile(r"^\[([A-Za-z0-9][A-Za-z0-9_.-]*):(\d{1,7})\]:")
_EXCEPTHOOK = re.compile(r"^\[rank(\d{1,12})\]:(?: |(?=\[)|$)")
_TEMPLATE = re.compile(r"^\[([^\[\]\n]{1,120})\]:? ")
# (a field of its own: `rank=1`, `rank 1`, `rank1`, or `r1` as in `[${role_name}|r${rank}] `)
_TEMPLATE_RANK = re.compile(r"(?:^|[|,;\s])(?:global_)?(?:rank|r)[=:\s]?(\d{1,12})(?:$|[|,;\s/])", re.IGNORECASE)
# a trainer's own rank label in front of the lines it writes (SimpleTuner: `[RANK 1] 2026-05-19 ...`; a
# logging format's `[rank=2] `, `[rank: 2] `, `[Rank 2] `); torch's excepthook `[rank2]:` is not this
# (`[rank 2] ` and `[Rank 2] ` are a user's rank marker, read as such by the demuxer and the fast scan alike)
_RANK_LABEL = re.compile(r"^\[(?:[Rr][Aa][Nn][Kk][=:] ?|RANK )(\d{1,9})\]:? ")
# a line-prefix template's own label (`TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[r${rank}] '`): one short
# word (or none) and the rank; global for `r`/`rank` or no word, else the role's local rank, as --tee's
_BRACKET_LABEL = re.compile(r"^\[([A-Za-z_]{0,12})(\d{1,7})\] ")
_GLOBAL_WORDS = frozenset({"", "r", "rank"})
# a loop's own counters in brackets (`[epoch3] `, `[step120] `) are no rank label
_COUNTER_WORDS = frozenset("epoch ep e iter iteration it i step s batch b t loss round".split())
_TEMPLATE_LOCAL = re.compile(r"local(?:_rank)?[=:\s]?(\d{1,7})", re.IGNORECASE)
MAX_INDENT = 8
# a Markdown code fence around (or between parts of) a pasted log: not part of the log's conventions
_FENCE = re.compile(r"^\s*(?:```|~~~)[\w+.-]*\s*$")
_NOT_HOSTS = frozenset(
    "traceback file note warning warnings error info debug critical fatal exception failures time host rank "
    "exitcode error_file traceback root cause reason message http https std stdout stderr usage hint "
    "what caused step epoch loss iteration args kwargs key value none true false "
    # programs that name themselves before their message (`srun: error: node01: task 0: ...`)
    "srun slurmstepd sbatch salloc scontrol mpirun mpiexec orterun prterun bash sh python python3 "
    "torchrun deepspeed accelerate pdsh ssh".split())
_EXCEPTION_NAME = re.compile(r"(?:Error|Exception|Warning|Interrupt|Exit|Failure|Fault)$")
# a program or source file that names itself before its message (argparse's `train.py: error: ...`,
# `ProcessGroupNCCL.cpp: ...`), however many ranks repeat it
_SOURCE_FILE = re.compile(
    r"\.(?:py|pyx|sh|c|cc|cpp|cu|cuh|h|hpp|rs|go|java|js|ts|lua|pl|rb|jl|yaml|yml|json|toml|txt|log)$", re.IGNORECASE)


@dataclass(frozen=True)
class Dialect:
    """Which ambiguous prefix conventions this log uses, decided from a sample of its lines."""
    srun: bool = False
    stamped: bool = False      # every line starts with the log collector's RFC 3339 time
    clock_stamped: bool = False  # every line starts with a clock (`Nov 26 23:08:31 `, Kaggle's `704.7s\t1290\t`)
    pytest: bool = False       # a pytest failure report: the exception's lines start with `E   `
    quoted: bool = False       # every line starts with a Markdown quote's `> ` (or `quote_mark`)
    quote_mark: str = ">"      # `#`: the log was pasted as comments
    wrapper_tag: str = ""      # most lines start with this supervisor's `[TAG] `
    pods: bool = False         # lines start with `kubectl logs --prefix`'s `[pod/<pod>/<container>] ` (a node)
    srun_nodes: bool = False   # srun tasks are nodes (one torchrun each), not ranks
    hosts: frozenset[str] = field(default_factory=frozenset)
    indent: int = 0            # blanks in front of every line: a paste indented as a code block (or by tabs)
    gutter: bool = False       # every line starts with its line number (a log viewer's copy)
    bracket_label: str | None = None   # the word of a template's `[r1] ` label on many lines ("" for `[1] `)
    # a node's local ranks (`--tee`'s `[default2]:`) that are not its global ranks, with no host label to
    # scope them: a later node's console (pasted after the first), or one node's alone
    local_scoped: bool = False
    # a launcher's console: its agent's own lines, or several ranks' prefixes (a file named for a
    # node, `worker-1.log`, is not that rank's output)
    agent_console: bool = False
    wrap_width: int = 0        # a hard-wrapped paste: rows of this width continue on the next (demux/wrapped.py)
    rich_gutter: int = 0       # rich's logging layout: the message column starts here (time and level before it)

    @property
    def exact_only(self) -> bool:
        """Prefix layers the fast scan's compiled kernel does not parse: such a log takes the exact
        path (srun tasks as nodes, hosts, a console clock, pytest's `E`, quotes, a supervisor's tag,
        kubectl's pods, a line-number gutter, a template's `[r5] ` label, local ranks that are not global
        ones, hard-wrapped rows, rich's logging columns)."""
        return bool(self.srun_nodes or self.hosts or self.clock_stamped or self.pytest or self.quoted
                    or self.wrapper_tag or self.pods or self.gutter or self.bracket_label is not None
                    or self.local_scoped or self.wrap_width or self.rich_gutter)

    def labelled(self, row: str) -> bool:
        """Whether a row starts with a label this log's lines carry (a hard wrap's next row does not)."""
        return labelled(row, self.srun)

    @cached_property
    def label_patterns(self) -> tuple[tuple[str, re.Pattern], ...]:
        """The per-line labels this log uses, outermost first (decided once, read for every line)."""
        used = (("gutter", _GUTTER, self.gutter), ("stamp", _COLLECTOR_STAMP, self.stamped), ("stamp", _CLOCK_STAMP, self.clock_stamped),
                ("tag", _WRAPPER_TAG, bool(self.wrapper_tag)), ("pod", _KUBECTL, self.pods),
                ("pytest", _PYTEST_E, self.pytest), ("srun", _SRUN, self.srun), ("mpi", _MPI, True),
                ("host", _HOST, bool(self.hosts)))
        return tuple((layer, pattern) for layer, pattern, on in used if on)

    @classmethod
    def detect(cls, sample: Iterable[str]) -> "Dialect":
        lines = [line for line in sample if line.strip() and not _FENCE.match(line)]
        srun_labels = sum(1 for line in lines if _SRUN.match(line)) * 3 >= len(lines)
        wrapped = wrap_width(lines, lambda row: labelled(row, srun_labels))
        span = environment_report_span(lines)
        if span is not None:
            lines = lines[:span[0]] + lines[span[1]:]
        if not lines:
            return cls()
        indent = len(_common_indent(lines))
        indent = min(indent, MAX_INDENT)
        if indent:
            lines = [line[indent:] for line in lines]
        found = next((mark for mark in _QUOTE_MARKS
                      if sum(1 for line in lines if _quoted(line, mark)) * 3 >= len(lines) * 2), None)
        quote_mark = found or ">"
        quoted = len(lines) >= 2 and found is not None
        if quoted:
            lines = [_unquote(line, quote_mark) for line in lines]
        gutter = _numbered(lines)
        if gutter:
            lines = [_GUTTER.sub("", line, count=1) for line in lines]
        stamped = sum(1 for line in lines if _COLLECTOR_STAMP.match(line)) * 3 >= len(lines) * 2
        if stamped:
            lines = [_COLLECTOR_STAMP.sub("", line, count=1) for line in lines]
        clock_stamped = not stamped and sum(1 for line in lines if _CLOCK_STAMP.match(line)) * 3 >= len(lines) * 2
        if clock_stamped:
            lines = [_CLOCK_STAMP.sub("", line, count=1) for line in lines]
        wrapper_tag = _wrapper_tag(lines)
        if wrapper_tag:
            lines = [line.removeprefix(f"[{wrapper_tag}] ") for line in lines]
        pods = not wrapper_tag and sum(1 for line in lines if _KUBECTL.match(line)) * 3 >= len(lines) * 2
        if pods:
            lines = [_KUBECTL.sub("", line, count=1) for line in lines]
        pytest_lines = [line for line in lines if _PYTEST_E.match(line)]
        # two report lines, or one that holds an exception (`E       RuntimeError: ...`)
        pytest = len(pytest_lines) >= 2 or any(_PYTEST_EXCEPTION.match(line) for line in pytest_lines)
        srun_hits = sum(1 for line in lines if _SRUN.match(line))
        hosts = Counter()
        for line in lines:
            rest = line
            m = _SRUN.match(rest)
            if m and srun_hits * 3 >= len(lines):
                rest = rest[m.end():]
            m = _HOST.match(rest)
            if m:
                hosts[m.group(1)] += 1
        floor = max(5, len(lines) // 20)
        chosen = frozenset(h for h, n in hosts.items() if n >= floor and _host_like(h))
        named = {h: n for h, n in hosts.items() if _host_like(h) and any(c.isdigit() or c in "-." for c in h)}
        if len(lines) >= 3 and sum(named.values()) * 3 >= len(lines) * 2:
            # a short paste where (nearly) every line carries a node name (`node01: `, `node-b: `):
            # too few lines for the floor, but the convention is plain
            chosen |= frozenset(named)
        srun = srun_hits * 3 >= len(lines) and srun_hits >= 3
        bracket_label = _bracket_label(lines, srun)
        srun_nodes = srun and _tasks_are_nodes(lines)
        return cls(srun=srun, stamped=stamped, clock_stamped=clock_stamped, pytest=pytest, quoted=quoted,
                   quote_mark=quote_mark,
                   wrapper_tag=wrapper_tag, pods=pods,
                   hosts=chosen, srun_nodes=srun_nodes, indent=indent, gutter=gutter,
                   bracket_label=bracket_label,
                   local_scoped=not chosen and not pods and not srun_nodes and _locals_not_global(lines),
                   agent_console=_a_console(lines), wrap_width=wrapped, rich_gutter=_rich_gutter(lines))


def labelled(row: str, srun: bool) -> bool:
    """Whether a row starts with a rank's, a tee's, Open MPI's or (where the log uses them) srun's label."""
    return bool(_TEE.match(row) or _TEE_HOST.match(row) or _EXCEPTHOOK.match(row) or _MPI.match(row)
                or (srun and _SRUN.match(row)))


def _quoted(line: str, mark: str) -> bool:
    """The line starts with the quote mark (`#` only as a comment's: before a blank or the end)."""
    return line.startswith(mark) and (mark == ">" or line[len(mark):len(mark) + 1] in ("", " "))


def _unquote(line: str, mark: str) -> str:
    """The line without its quote mark and one blank after it (a quote's quote's marks too:
    `> > `, `>> `)."""
    text = line[len(mark):] if line.startswith(mark) else line
    text = text[1:] if text.startswith(" ") else text
    if mark == ">":
        while text.startswith(">"):
            text = text[2:] if text.startswith("> ") else text[1:]
    return text


def _numbered(lines: list[str]) -> bool:
    """Whether (nearly) every line starts with its line number: numbers that rise by one from
    line to line and do not come round again."""
    matches = [_GUTTER.match(line) for line in lines]
    numbers = [int(m.group(1)) if m else None for m in matches]
    rising = sum(1 for a, b in zip(numbers, numbers[1:]) if a is not None and b == a + 1)
    seen = [n for n in numbers if n is not None]
    # (srun's labels of ranks printing in turn rise by one too, but come round again; a bar after
    # the number is no srun label, so a short paste shows the gutter too)
    barred = sum(1 for m in matches if m and "|" in m.group(0)) * 3 >= len(lines) * 2
    return (len(lines) >= (3 if barred else 10) and rising * 3 >= (len(lines) - 1) * 2
            and len(set(seen)) * 10 >= len(seen) * 9)


def _bracket_label(lines: list[str], srun: bool) -> str | None:
    """The word of the `[<word><n>] ` label a third of the lines start with (inside srun's or Open
    MPI's own label), with at least two numbers: a line-prefix template's rank label; else None."""
    numbers: dict[str, set[int]] = {}
    counts: Counter = Counter()
    for line in lines:
        m = (_SRUN.match(line) if srun else None) or _MPI.match(line)
        rest = line[m.end():] if m else line
        label = _BRACKET_LABEL.match(rest)
        if label:
            counts[label.group(1)] += 1
            numbers.setdefault(label.group(1), set()).add(int(label.group(2)))
    if not counts:
        return None
    word, count = counts.most_common(1)[0]
    if count * 3 < len(lines) or len(numbers[word]) < 2 or word.lower() in _NOT_TAGS | _COUNTER_WORDS:
        return None
    return word


def _wrapper_tag(lines: list[str]) -> str:
    """The `[TAG]` a supervisor puts on (nearly) every line, if any; log levels are not tags."""
    tags = Counter(m.group(1) for m in map(_WRAPPER_TAG.match, lines) if m)
    if not tags:
        return ""
    tag, count = tags.most_common(1)[0]
    return tag if count * 3 >= len(lines) * 2 and tag.strip().lower() not in _NOT_TAGS else ""


def _common_indent(lines: list[str]) -> str:
    """The blanks (spaces or tabs, not mixed across lines) in front of every line."""
    first = lines[0]
    common = first[:len(first) - len(first.lstrip(" \t"))]
    for line in lines[1:]:
        n = 0
        while n < len(common) and n < len(line) and line[n] == common[n]:
            n += 1
        common = common[:n]
        if not common:
            break
    return common


_AGENT_LINE = re.compile(r"^[IWEC]\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ \S*distributed/(?:run|elastic|launcher)")


def _tasks_are_nodes(lines: list[str]) -> bool:
    """Under `srun --label torchrun ...` each task is a node's launcher: its label names the node,
    and the agent's own lines or `[rankN]:` prefixes with another number show it."""
    for line in lines:
        m = _SRUN.match(line)
        if not m:
            continue
        rest = line[m.end():]
        if _AGENT_LINE.match(rest):
            return True
        r = _EXCEPTHOOK.match(rest)
        if r and r.group(1) != m.group(1):
            return True
    return False


def _locals_not_global(lines: list[str]) -> bool:
    """Whether `--tee`'s local ranks are another node's: a `[default2]:[rank6]:` line, or a
    launcher summary's `rank : 6 (local_rank: 2)` entry (one node's console pasted alone). Not
    where one local rank's lines keep switching between global ranks: several nodes interleaved in
    one console without labels, which no console scope can tell apart."""
    differs = False
    last: dict[str, str] = {}
    switches: Counter = Counter()
    for line in lines:
        if line[:1] == "[":
            m = _TEE.match(line)
            if m and m.group(1) != "rank":
                r = _EXCEPTHOOK.match(line[m.end():])
                if r:
                    local, rank = m.group(2), r.group(1)
                    differs = differs or rank != local
                    if last.setdefault(local, rank) != rank:
                        last[local] = rank
                        switches[local] += 1
                        if switches[local] > 2:
                            return False
        elif "local_rank" in line:
            m = CFE_RANK.match(line)
            if m and m.group(1) != m.group(2):
                differs = True
    return differs


def _rich_gutter(lines: list[str]) -> int:
    """The width of rich's time and level columns where three records or more are laid out by its
    logging handler (the same width each time), else 0."""
    widths: Counter = Counter()
    for line in lines:
        m = _EXCEPTHOOK.match(line) or _TEE.match(line) or _TEE_HOST.match(line) if line[:1] == "[" else None
        head = _RICH_HEAD.match(line[m.end():] if m else line)
        if head:
            widths[head.end()] += 1
    if not widths:
        return 0
    width, count = widths.most_common(1)[0]
    return width if count >= 3 else 0


def _rich_message(text: str, gutter: int) -> tuple[str, bool]:
    """A row of rich's logging layout from its level on, without the caller's path at the right (a
    record's first row: `ERROR    step failed: ...`), or without its blank gutter (a row the record
    wrapped onto)."""
    head = _RICH_HEAD.match(text)
    if head and head.end() == gutter:
        return _RICH_PATH.sub("", text[head.start("level"):]).rstrip(), True
    wrapped = len(text) > gutter and text[:gutter].isspace() and not text[gutter].isspace()
    indented = text[:gutter + 2].isspace() and bool(text.strip())   # deeper than the gutter: a frame's source line
    if wrapped or indented:
        return text[gutter:].rstrip(), True
    return text, False


def _a_console(lines: list[str]) -> bool:
    """Whether the sample is a launcher's console: an agent's own line, or prefixes (--tee's local
    rank, the excepthook's global one) naming two ranks or more."""
    ranks: set[str] = set()
    for line in lines:
        if line[:1] == "[":
            m = _EXCEPTHOOK.match(line) or _TEE.match(line)
            if m:
                ranks.add(m.group(m.lastindex))
                if len(ranks) >= 2:
                    return True
        elif _AGENT_LINE.match(line):
            return True
    return False


def _host_like(token: str) -> bool:
    if token.lower() in _NOT_HOSTS or _EXCEPTION_NAME.search(token) or _SOURCE_FILE.search(token):
        return False
    if token[0].isupper() and token[1:].islower() and token.isalpha():
        return False  # "Note", "Warning"-like words
    return any(c.isdigit() or c in "-." for c in token) or token.islower()


def _line_labels(line: str, dialect: Dialect) -> tuple[str, list[tuple[str, re.Match | None]]]:
    """The labels a launcher or collector puts on every physical line, outermost first (paste
    indent, Markdown quote, collector or console clock, pytest's `E`, srun label, Open MPI tag,
    pdsh host): the text after them, and each label's layer name and match."""
    text, labels = line, []
    if dialect.indent and text[:dialect.indent].isspace() and len(text) >= dialect.indent:
        text = text[dialect.indent:]
        labels.append(("indent", None))
    if dialect.quoted and _quoted(text, dialect.quote_mark):
        text = _unquote(text, dialect.quote_mark)
        labels.append(("quote", None))
    for layer, pattern in dialect.label_patterns:
        m = pattern.match(text)
        if m and (layer != "host" or m.group(1) in dialect.hosts) \
                and (layer != "tag" or m.group(1) == dialect.wrapper_tag):
            text = text[m.end():]
            labels.append((layer, m))
    return text, labels


def line_prefix_end(line: str, dialect: Dialect) -> int:
    """Where the labels on every physical line end: two ranks' output glued on one line under a
    host's label are both that host's, so each piece keeps it."""
    return len(line) - len(_line_labels(line, dialect)[0])


@dataclass(frozen=True, slots=True)
class Prefixes:
    text: str                   # the message after every recognised prefix
    rank: int | None = None     # global rank named by srun / MPI / template / excepthook / C++
    local_rank: int | None = None
    host: str | None = None
    layers: tuple[str, ...] = ()

    @property
    def any_rank(self) -> int | None:
        return self.rank if self.rank is not None else self.local_rank


def strip_prefixes(line: str, dialect: Dialect) -> Prefixes:
    text, labels = _line_labels(line, dialect)
    rank, local, host = None, None, None
    for layer, m in labels:
        if layer == "srun" and dialect.srun_nodes:
            host = f"task{int(m.group(1))}"
        elif layer == "srun":
            rank = int(m.group(1))
        elif layer == "mpi":
            rank = int(m.group(2))
        elif layer in ("host", "pod"):
            host = m.group(1)
    layers = [layer for layer, _ in labels]
    m = _RAY.match(text) if text[:1] == "(" else None
    if m:
        text = text[m.end():]
        named = m.group(1) or m.group(2) or m.group(3)
        if named is not None:
            rank = int(named)
        if m.group(4) is not None:
            host = f"node{int(m.group(4))}"   # SkyPilot numbers nodes; the processes' ranks come after
        layers.append("vllm" if _VLLM_PROCESS.match(m.group(0)) else "ray")
    m = _STREAM_TAG.match(text) if text[:4] == "[std" else None
    if m:
        text = text[m.end():]
        layers.append("tag")
    m = _BRACKET_LABEL.match(text) if dialect.bracket_label is not None and text[:1] == "[" else None
    if m and m.group(1) == dialect.bracket_label:
        if m.group(1).lower() in _GLOBAL_WORDS:
            rank = int(m.group(2))
        else:
            local = int(m.group(2))
        text = text[m.end():]
        layers.append("template")
    m = _TEE_HOST.match(text)
    if m:
        host, local, text = m.group(1), int(m.group(2)), text[m.end():]
        layers.append("tee")
    else:
        m = _TEE.match(text)
        # `[rank0]:` is torch's excepthook prefix (a space or a C++ log header after it), or the
        # --tee header of `--role rank` (the message right after it: `[rank0]:NCCL version 2.29.7`)
        if m and (m.group(1) != "rank" or not _EXCEPTHOOK.match(text)):
            local, text = int(m.group(2)), text[m.end():]
            layers.append("tee")
    if dialect.rich_gutter:
        if "/s]" in text or "/it]" in text:   # a progress bar, and the record glued after it
            text = after_bar(text)
        text, laid_out = _rich_message(text, dialect.rich_gutter)
        if laid_out:
            layers.append("rich")
    m = _TEMPLATE.match(text)
    if m and not _EXCEPTHOOK.match(text):
        inner = m.group(1)
        r = _TEMPLATE_RANK.search(inner)
        if r and ("|" in inner or "=" in inner):
            rank, text = int(r.group(1)), text[m.end():]
            lm = _TEMPLATE_LOCAL.search(inner)
            if lm:
                local = int(lm.group(1))
            layers.append("template")
    m = _RANK_LABEL.match(text) if text[:2] in ("[r", "[R") else None
    if m and rank is None:
        rank, text = int(m.group(1)), text[m.end():]
        layers.append("template")
    m = _EXCEPTHOOK.match(text)
    if m:
        rank = int(m.group(1))
        text = text[m.end():]
        again = _EXCEPTHOOK.match(text)
        if again and int(again.group(1)) == rank:
            text = text[again.end():]   # torch 2.6+ can print the rank prefix twice: `[rank0]:[rank0]: `
        layers.append("excepthook" if not text.startswith("[") else "cpp")
    return Prefixes(text, rank, local, host, tuple(layers))
