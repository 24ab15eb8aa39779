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
    empty template      `[]:`                     (a template whose fields the shell emptied; no rank)
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
from dataclasses import dataclass

from logtriage.demux.clean import after_bar
from logtriage.demux.dialect import Dialect
from logtriage.demux.prefix_shapes import (
    BRACKET_LABEL, EXCEPTHOOK, GLOBAL_WORDS, RANK_LABEL, RAY, RICH_HEAD, RICH_PATH, SPACED_RANK_LABEL, STREAM_TAG, TEE,
    TEE_HOST, TEE_WIDE, TEMPLATE, TEMPLATE_LOCAL, TEMPLATE_RANK, TEMPLATE_ROLE_RANK, VLLM_PROCESS, is_quoted, unquote)

__all__ = ["Dialect", "Prefixes", "line_prefix_end", "strip_prefixes"]


def _rich_message(text: str, gutter: int) -> tuple[str, bool]:
    """A row of rich's logging layout from its level on, without the caller's path at the right (a
    record's first row: `ERROR    step failed: ...`), or without its blank gutter (a row the record
    wrapped onto)."""
    head = RICH_HEAD.match(text)
    if head and head.end() == gutter:
        return RICH_PATH.sub("", text[head.start("level"):]).rstrip(), True
    wrapped = len(text) > gutter and text[:gutter].isspace() and not text[gutter].isspace()
    indented = text[:gutter + 2].isspace() and bool(text.strip())   # deeper than the gutter: a frame's source line
    if wrapped or indented:
        return text[gutter:].rstrip(), True
    return text, False


def _line_labels(line: str, dialect: Dialect) -> tuple[str, list[tuple[str, re.Match | None]]]:
    """The labels a launcher or collector puts on every physical line, outermost first (paste
    indent, Markdown quote, collector or console clock, pytest's `E`, srun label, Open MPI tag,
    pdsh host): the text after them, and each label's layer name and match."""
    text, labels = line, []
    if dialect.indent and text[:dialect.indent].isspace() and len(text) >= dialect.indent:
        text = text[dialect.indent:]
        labels.append(("indent", None))
    if dialect.quoted and is_quoted(text, dialect.quote_mark):
        text = unquote(text, dialect.quote_mark)
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


def _role_rank_fields(inner: str) -> tuple[int, int | None] | None:
    """The global rank and the local rank of a template whose one field glues the role name to the
    rank (`default1|1`: `${role_name}${rank}|${local_rank}`); the other fields are numbers or words."""
    fields = inner.split("|")
    named = [m for m in map(TEMPLATE_ROLE_RANK.fullmatch, fields) if m]
    numbers = [f for f in fields if f.isdigit() and len(f) <= 7]
    if len(named) != 1 or any(not (f.isdigit() or f.isalpha()) for f in fields if f != named[0].group(0)):
        return None
    return int(named[0].group(1)), int(numbers[0]) if len(numbers) == 1 else None


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
    m = RAY.match(text) if text[:1] == "(" else None
    if m:
        text = text[m.end():]
        named = m.group(1) or m.group(2) or m.group(3)
        if named is not None:
            rank = int(named)
        if m.group(4) is not None:
            host = f"node{int(m.group(4))}"   # SkyPilot numbers nodes; the processes' ranks come after
        layers.append("vllm" if VLLM_PROCESS.match(m.group(0)) else "ray")
    m = STREAM_TAG.match(text) if text[:4] == "[std" else None
    if m:
        text = text[m.end():]
        layers.append("tag")
    m = BRACKET_LABEL.match(text) if dialect.bracket_label is not None and text[:1] == "[" else None
    if m and m.group(1) == dialect.bracket_label:
        if m.group(1).lower() in GLOBAL_WORDS:
            rank = int(m.group(2))
        else:
            local = int(m.group(2))
        text = text[m.end():]
        layers.append("template")
    if text[:3] == "[]:":
        # a line-prefix template whose fields the shell expanded to nothing before torchrun read it
        # (`TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[${role_name}${rank}]:"` in double quotes): it names no
        # rank, and what follows it is read as on any line (cpu_adhoc 528th batch)
        text = text[3:]
        layers.append("template")
    m = TEE_HOST.match(text)
    if m:
        host, local, text = m.group(1), int(m.group(2)), text[m.end():]
        layers.append("tee")
    else:
        m = TEE.match(text) or (TEE_WIDE.match(text) if not text[1:2].isascii() else None)
        # `[rank0]:` is torch's excepthook prefix (a space or a C++ log header after it), or the
        # --tee header of `--role rank` (the message right after it: `[rank0]:NCCL version 2.29.7`)
        if m and (m.group(1) != "rank" or not EXCEPTHOOK.match(text)):
            local, text = int(m.group(2)), text[m.end():]
            layers.append("tee")
    if dialect.rich_gutter:
        if "/s]" in text or "/it]" in text:   # a progress bar, and the record glued after it
            text = after_bar(text)
        text, laid_out = _rich_message(text, dialect.rich_gutter)
        if laid_out:
            layers.append("rich")
    m = TEMPLATE.match(text)
    if m and not EXCEPTHOOK.match(text):
        inner = m.group(1)
        r = TEMPLATE_RANK.search(inner)
        if r and ("|" in inner or "=" in inner or "/" in inner):   # `default|r0`, `rank=0`, `default-r0/l0`
            rank, text = int(r.group(1)), text[m.end():]
            lm = TEMPLATE_LOCAL.search(inner)
            if lm:
                local = int(lm.group(1))
            layers.append("template")
        elif "|" in inner and (fields := _role_rank_fields(inner)) is not None:
            rank, local, text = fields[0], fields[1], text[m.end():]
            layers.append("template")
        elif "|" in inner and EXCEPTHOOK.match(text[m.end():]):
            # a template whose rank field the tool cannot read (`[default|第1卡] `: "card 1"), before
            # torch's own `[rank1]: ` that names the rank: the label goes, the excepthook's rank stays
            text = text[m.end():]
            layers.append("template")
    m = RANK_LABEL.match(text) if text[:2] in ("[r", "[R") else None
    if m and rank is None:
        rank, text = int(m.group(1)), text[m.end():]
        layers.append("template")
    elif text[:6] in ("[rank ", "[Rank ") and (m := SPACED_RANK_LABEL.match(text)):
        # a hand-made launcher's label (`sed "s/^/[rank $R] /"`) before torch's own `[rank2]: ` that names the
        # same rank: the label goes and the excepthook's traceback is read (alone, `[rank 2] ` stays a marker
        # in the text, as a program's logging format writes it)
        inner = EXCEPTHOOK.match(text[m.end():])
        if inner and inner.group(1) == m.group(1) and rank is None:
            text = text[m.end():]
            layers.append("template")
    m = EXCEPTHOOK.match(text)
    if m:
        rank = int(m.group(1))
        text = text[m.end():]
        # torch 2.6+ can print the rank prefix twice (`[rank0]:[rank0]: `), and a process that called
        # init_process_group again (a sweep's trials) once more for every hook it installed
        while (again := EXCEPTHOOK.match(text)) and int(again.group(1)) == rank:
            text = text[again.end():]
        layers.append("excepthook" if not text.startswith("[") else "cpp")
    return Prefixes(text, rank, local, host, tuple(layers))
