"""Which ambiguous prefix conventions a log uses (srun's `3: `, a host's `node1: `, a collector's stamp,
a paste's indent or quote...), decided once from a sample of its lines."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable

from logtriage.demux.around_paste import environment_report_span
from logtriage.demux.launcher import CFE_RANK
from logtriage.demux.prefix_shapes import (
    BRACKET_LABEL, CLOCK_STAMP, COLLECTOR_STAMP, COUNTER_WORDS, EXCEPTHOOK, EXCEPTION_NAME, FENCE, GUTTER,
    BRACKET_HOST, HOST, KUBECTL, MAX_INDENT, MPI, NOT_HOSTS, NOT_TAGS, PYTEST_E, PYTEST_EXCEPTION, QUOTE_MARKS, RICH_HEAD,
    SOURCE_FILE, SRUN, TEE, TEE_HOST, WRAPPER_TAG, labelled, is_quoted, unquote)
from logtriage.demux.wrapped import wrap_width


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
    bracket_hosts: bool = False        # hosts are labelled `[node1] ` (a bracketed word torch's `[rankN]: ` belies)
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
        used = (("gutter", GUTTER, self.gutter), ("stamp", COLLECTOR_STAMP, self.stamped), ("stamp", CLOCK_STAMP, self.clock_stamped),
                ("tag", WRAPPER_TAG, bool(self.wrapper_tag)), ("pod", KUBECTL, self.pods),
                ("pytest", PYTEST_E, self.pytest), ("srun", SRUN, self.srun), ("mpi", MPI, True),
                ("host", BRACKET_HOST if self.bracket_hosts else HOST, bool(self.hosts)))
        return tuple((layer, pattern) for layer, pattern, on in used if on)

    @classmethod
    def detect(cls, sample: Iterable[str]) -> "Dialect":
        lines = [line for line in sample if line.strip() and not FENCE.match(line)]
        srun_labels = sum(1 for line in lines if SRUN.match(line)) * 3 >= len(lines)
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
        found = next((mark for mark in QUOTE_MARKS
                      if sum(1 for line in lines if is_quoted(line, mark)) * 3 >= len(lines) * 2), None)
        quote_mark = found or ">"
        quoted = len(lines) >= 2 and found is not None
        if quoted:
            lines = [unquote(line, quote_mark) for line in lines]
        gutter = _numbered(lines)
        if gutter:
            lines = [GUTTER.sub("", line, count=1) for line in lines]
        stamped = sum(1 for line in lines if COLLECTOR_STAMP.match(line)) * 3 >= len(lines) * 2
        if stamped:
            lines = [COLLECTOR_STAMP.sub("", line, count=1) for line in lines]
        clock_stamped = not stamped and sum(1 for line in lines if CLOCK_STAMP.match(line)) * 3 >= len(lines) * 2
        if clock_stamped:
            lines = [CLOCK_STAMP.sub("", line, count=1) for line in lines]
        wrapper_tag = _wrapper_tag(lines)
        if wrapper_tag:
            lines = [line.removeprefix(f"[{wrapper_tag}] ") for line in lines]
        pods = not wrapper_tag and sum(1 for line in lines if KUBECTL.match(line)) * 3 >= len(lines) * 2
        if pods:
            lines = [KUBECTL.sub("", line, count=1) for line in lines]
        pytest_lines = [line for line in lines if PYTEST_E.match(line)]
        # two report lines, or one that holds an exception (`E       RuntimeError: ...`)
        pytest = len(pytest_lines) >= 2 or any(PYTEST_EXCEPTION.match(line) for line in pytest_lines)
        srun_hits = sum(1 for line in lines if SRUN.match(line))
        srun = srun_hits * 3 >= len(lines) and srun_hits >= 3
        bracket_label, bracket_hosts = _bracket_label(lines, srun)
        hosts = Counter()
        for line in lines:
            rest = line
            m = SRUN.match(rest)
            if m and srun_hits * 3 >= len(lines):
                rest = rest[m.end():]
            m = (BRACKET_HOST if bracket_hosts else HOST).match(rest)
            if m:
                hosts[m.group(1)] += 1
        floor = max(5, len(lines) // 20)
        chosen = frozenset(h for h, n in hosts.items() if n >= floor and _host_like(h))
        named = {h: n for h, n in hosts.items() if _host_like(h) and any(c.isdigit() or c in "-." for c in h)}
        if len(lines) >= 3 and sum(named.values()) * 3 >= len(lines) * 2:
            # a short paste where (nearly) every line carries a node name (`node01: `, `node-b: `):
            # too few lines for the floor, but the convention is plain
            chosen |= frozenset(named)
        srun_nodes = srun and _tasks_are_nodes(lines)
        return cls(srun=srun, stamped=stamped, clock_stamped=clock_stamped, pytest=pytest, quoted=quoted,
                   quote_mark=quote_mark,
                   wrapper_tag=wrapper_tag, pods=pods,
                   hosts=chosen, srun_nodes=srun_nodes, indent=indent, gutter=gutter,
                   bracket_label=bracket_label, bracket_hosts=bracket_hosts and bool(chosen),
                   local_scoped=not chosen and not pods and not srun_nodes and _locals_not_global(lines),
                   agent_console=_a_console(lines), wrap_width=wrapped, rich_gutter=_rich_gutter(lines))


def _numbered(lines: list[str]) -> bool:
    """Whether (nearly) every line starts with its line number: numbers that rise by one from
    line to line and do not come round again."""
    matches = [GUTTER.match(line) for line in lines]
    numbers = [int(m.group(1)) if m else None for m in matches]
    rising = sum(1 for a, b in zip(numbers, numbers[1:]) if a is not None and b == a + 1)
    seen = [n for n in numbers if n is not None]
    # (srun's labels of ranks printing in turn rise by one too, but come round again; a bar after
    # the number is no srun label, so a short paste shows the gutter too)
    barred = sum(1 for m in matches if m and "|" in m.group(0)) * 3 >= len(lines) * 2
    return (len(lines) >= (3 if barred else 10) and rising * 3 >= (len(lines) - 1) * 2
            and len(set(seen)) * 10 >= len(seen) * 9)


def _bracket_label(lines: list[str], srun: bool) -> tuple[str | None, bool]:
    """The word of the `[<word><n>] ` label a third of the lines start with (inside srun's or Open
    MPI's own label), with at least two numbers: a line-prefix template's rank label; else None. And
    whether the label is a node's instead: torch's own `[rankN]: ` after it mostly names another N."""
    numbers: dict[str, set[int]] = {}
    counts: Counter = Counter()
    confirmed: Counter = Counter()    # lines where torch's own `[rankN]: ` after the label names the same N
    contradicted: Counter = Counter()  # ... names another N (`[node1] [rank3]: `: a host's label, not a rank's)
    for line in lines:
        m = (SRUN.match(line) if srun else None) or MPI.match(line)
        rest = line[m.end():] if m else line
        label = BRACKET_LABEL.match(rest)
        if label:
            counts[label.group(1)] += 1
            numbers.setdefault(label.group(1), set()).add(int(label.group(2)))
            hook = EXCEPTHOOK.match(rest[label.end():])
            if hook and hook.group(1) == label.group(2):
                confirmed[label.group(1)] += 1
            elif hook:
                contradicted[label.group(1)] += 1
    if not counts:
        return None, False
    word, count = counts.most_common(1)[0]
    if contradicted[word] > max(1, confirmed[word]):
        return None, count * 3 >= len(lines)
    if (count * 3 < len(lines) and confirmed[word] < 2) or len(numbers[word]) < 2 \
            or word.lower() in NOT_TAGS | COUNTER_WORDS:
        return None, False
    return word, False


def _wrapper_tag(lines: list[str]) -> str:
    """The `[TAG]` a supervisor puts on (nearly) every line, if any; log levels are not tags."""
    tags = Counter(m.group(1) for m in map(WRAPPER_TAG.match, lines) if m)
    if not tags:
        return ""
    tag, count = tags.most_common(1)[0]
    return tag if count * 3 >= len(lines) * 2 and tag.strip().lower() not in NOT_TAGS else ""


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
        m = SRUN.match(line)
        if not m:
            continue
        rest = line[m.end():]
        if _AGENT_LINE.match(rest):
            return True
        r = EXCEPTHOOK.match(rest)
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
            m = TEE.match(line)
            if m and m.group(1) != "rank":
                r = EXCEPTHOOK.match(line[m.end():])
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
        m = EXCEPTHOOK.match(line) or TEE.match(line) or TEE_HOST.match(line) if line[:1] == "[" else None
        head = RICH_HEAD.match(line[m.end():] if m else line)
        if head:
            widths[head.end()] += 1
    if not widths:
        return 0
    width, count = widths.most_common(1)[0]
    return width if count >= 3 else 0


def _a_console(lines: list[str]) -> bool:
    """Whether the sample is a launcher's console: an agent's own line, or prefixes (--tee's local
    rank, the excepthook's global one) naming two ranks or more."""
    ranks: set[str] = set()
    for line in lines:
        if line[:1] == "[":
            m = EXCEPTHOOK.match(line) or TEE.match(line)
            if m:
                ranks.add(m.group(m.lastindex))
                if len(ranks) >= 2:
                    return True
        elif _AGENT_LINE.match(line):
            return True
    return False


def _host_like(token: str) -> bool:
    if token.lower() in NOT_HOSTS or EXCEPTION_NAME.search(token) or SOURCE_FILE.search(token):
        return False
    if token[0].isupper() and token[1:].islower() and token.isalpha():
        return False  # "Note", "Warning"-like words
    return any(c.isdigit() or c in "-." for c in token) or token.islower()
