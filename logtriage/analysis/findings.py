"""Findings: rule hits resolved to their final stream and rank.

Three attributions happen here, after the whole input was read:
- slots become streams (pid -> rank, segment -> attempt, bare blocks -> owners);
- a launcher line about one worker (a ChildFailedError entry, `failed (exitcode: ...) local_rank:`,
  `ProcessExitedException: process 1 ...`, srun `task 3`) is about that worker's rank;
- an unattributed native crash (`Fatal Python error: Segmentation fault`) belongs to the one
  rank the launcher saw die of that signal."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Mapping

from logtriage.analysis.childfailed import ChildFailure, signal_name
from logtriage.analysis.clock_offsets import clock_offsets, on_reference_clock
from logtriage.analysis.exception_names import CALLBACK_WRAPPED, exception_type_of, short_type, unglued
from logtriage.analysis.loss_came_back import mark_loss_came_back
from logtriage.analysis.record_stamps import record_stamps
from logtriage.analysis.same_event import one_reading_per_event
from logtriage.analysis.timestamps import Stamp
from logtriage.analysis.went_on import mark_went_on
from logtriage.catalog.rule import Category, Role, Rule, Severity
from logtriage.demux.streams import StreamKey, StreamKind
from logtriage.scan_result import Hit, ScanResult

# Exception types that are consequences of another failure, not causes, when nothing more
# specific matched their line.
CASCADE_EXCEPTION_TYPES = frozenset({
    "DistBackendError", "DistNetworkError", "DistStoreError", "DistError", "ChildFailedError",
    "SignalException", "KeyboardInterrupt", "BrokenPipeError", "ConnectionResetError",
    "ConnectionRefusedError", "ProcessExitedException", "ProcessRaisedException", "SystemExit",
    "CalledProcessError",
    # Spark's wrappers of a Python worker's failure (driver side, JVM side); the worker's own
    # traceback follows in them
    "Py4JJavaError", "PythonException",
    # Ray's driver-side reports of a remote task's or actor's failure; the remote traceback and
    # its own exception follow them (or the actor's process died with no Python error at all)
    "ActorDiedError", "RayActorError", "RayTaskError",
    # Ray Train's and Tune's run-level reports: the workers' own errors follow them in
    # `[Rank N Error Snippet]:` sections, or came earlier in the log
    "WorkerGroupError", "TrainingFailedError", "TuneError",
})
_SIGNAL_RULES = {"SIGSEGV": "signal.sigsegv", "SIGABRT": "signal.sigabrt", "SIGBUS": "signal.sigbus",
                 "SIGKILL": "signal.sigkill", "SIGTERM": "signal.sigterm"}
# Captures naming the rank of the process that printed the line ("[Rank 3] Watchdog caught ...",
# "Rank 1 is running collective"); used when the line itself carries no rank prefix.
SELF_RANK_CAPTURES = ("self_rank", "pg_rank")
# srun's notice of how a task (or tasks) ended: `srun: error: node01: task 3: Exited with exit code 1`
SRUN_TASK_NOTICE = re.compile(r"\s*srun: error: \S+: tasks? [\d,-]+: ")


def srun_tasks_are_nodes(scan: ScanResult, failures: list[ChildFailure]) -> bool:
    """srun started torchrun agents (its labels say so, or torchelastic summarised the workers):
    srun's `task N` is then a node's agent, not rank N."""
    return scan.srun_tasks_are_nodes or any(f.local_rank is not None for f in failures)


_WORKER_FIELDS = frozenset({"local_rank", "pid", "process", "task"})
_INFO_LINE = re.compile(r"^\[?I\d{3,4} \d\d:\d\d:\d\d")
# a line c10 (or torchelastic's logger) printed at WARNING level: `[W socket.cpp:601] ...`,
# `[W1130 10:00:00.123456789 socket.cpp:764] ...`, `W0422 05:07:49.013000 204 ...api.py:...] ...`,
# and Python logging's default format, `WARNING:megatron.core...:message`
_WARNING_LINE = re.compile(r"^\[?W\d{3,4} \d\d:\d\d:\d\d|^\[W [\w.]+:\d+\]|^WARNING:[\w.]+:")
# numbers, with a size's unit (`433.81 MiB` and `3.63 GiB` free on two ranks' GPUs are one kind of message) or a sign
# (`pearson -0.0411` and `pearson 0.1167` on two ranks are one line)
_MASK = re.compile(r"0x[0-9a-fA-F]+|(?:(?<![\w.-])-)?\d+(?:\.\d+)? ?(?:[KMGTP]i?B|bytes)\b|(?:(?<![\w.-])-)?\d+")


def mask_numbers(text: str) -> str:
    """The text with its numbers (and sizes with their unit) as `#`: what the same error on
    several ranks has in common."""
    return _MASK.sub("#", text)


@dataclass(frozen=True)
class Finding:
    rule: Rule
    captures: Mapping[str, str]
    source: int
    line: int
    stream: StreamKey
    rank: int | None
    text: str
    block_id: int
    seq: int
    stamp: Stamp | None
    attributed_by: str = "stream"     # stream | launcher | capture | signal | exit | nccl
    block_exception: str = ""         # the exception line of the traceback this line is in
    collective: str = ""              # the c10d function that traceback was in (all_reduce, barrier)
    checkpoint_frame: str = ""        # that traceback's checkpoint save/load frame (save_checkpoint)
    last_frame: str = ""              # that traceback's innermost function (where the process was)
    broadcast_src: int | None = None  # the src rank of the broadcast that traceback was in
    last_file: str = ""               # the file of last_frame (`.../site-packages/flash_attn/...`)
    went_on: bool = False             # the program said it went on from this (went_on.py)
    in_thread: bool = False           # that traceback is a thread's, printed as the thread died
    collective_site: str = ""         # the frame that called that collective (`train.py:148`)
    collective_caller: str = ""       # that frame's function (`main`)

    @property
    def role(self) -> Role:
        if self.rule.id == "python.exception" and short_type(self.exception_type) in CASCADE_EXCEPTION_TYPES:
            return Role.EITHER
        return self.rule.role

    @property
    def category(self) -> Category:
        return self.rule.category

    @property
    def is_error(self) -> bool:
        """An error finding; a line logged at INFO level (`I0228 ...`, `[I1130 ...]`) reports, it
        does not fail (the NCCL watchdog's INFO notes during a normal shutdown), and neither does
        one logged at WARNING level by a rule that says so (c10d's `[W socket.cpp:601] ... cannot
        be retrieved (gai error ...)`, after which it retries and usually connects), nor one the
        program's next lines say it went on from (went_on.py)."""
        return (self.rule.severity is Severity.ERROR and self.rule.role is not Role.CONTEXT
                and not _INFO_LINE.match(self.text) and not self.logged_as_warning and not self.went_on)

    @property
    def logged_as_warning(self) -> bool:
        """A finding of a rule whose text is benign at WARNING level, on a line its program logged
        at that level (most programs log real errors as warnings too: a port in use, an
        allocator's OOM)."""
        return self.rule.benign_at_warning_level and _WARNING_LINE.match(self.text) is not None

    @property
    def is_teardown(self) -> bool:
        return self.rule.teardown

    @property
    def fails_beyond_a_stop(self) -> bool:
        """An error that is neither the launcher's teardown nor a stop from outside: something failed."""
        return self.is_error and not self.is_teardown and self.category is not Category.EXTERNAL_STOP

    @property
    def exception_type(self) -> str | None:
        """The exception type as printed (`torch.OutOfMemoryError`), from the rule's capture or
        from the line itself when it is an exception line."""
        if self.block_exception.rstrip().endswith(" raised:") and self.block_exception != self.text:
            # a wrapper whose message is the exception it caught, on the lines below (dynamo's
            # `BackendCompilerFailed: backend='inductor' raised:` then `RuntimeError: ...`): the
            # exception raised is the wrapper; the line below says why
            wrapper = exception_type_of(self.block_exception)
            if wrapper:
                return wrapper
        captured = self.captures.get("exception_type")
        if captured and CALLBACK_WRAPPED in self.text:
            return exception_type_of(self.text) or unglued(captured)   # the callback's own exception
        return (unglued(captured) if captured else None) or exception_type_of(self.text) \
            or exception_type_of(self.block_exception)

    @property
    def signature(self) -> str:
        """What identical errors on several ranks share: rule and text with numbers masked."""
        return f"{self.rule.id}|{mask_numbers(self.text)}"


def resolve_findings(scan: ScanResult, keys: list[StreamKey], failures: list[ChildFailure]) -> list[Finding]:
    """Primary hit per line part, resolved to streams and ranks."""
    primary: dict[int, Hit] = {}
    extra: list[Hit] = []
    failing: set[int] = set()     # line parts with an error that is not teardown among their hits
    for hit in scan.hits:
        best = primary.get(hit.seq)
        if best is None:
            primary[hit.seq] = hit
        elif hit.rule.role is Role.CAUSE_CONFIRMATION:
            extra.append(hit)
        elif (_passive(best.rule) and not _passive(hit.rule) and hit.seq not in failing
              and hit.rule.id != "python.exception"):
            extra.append(hit)     # a whole paste on one line: the launcher's summary and the exit code in it
        if not _passive(hit.rule):
            failing.add(hit.seq)
    # an entry's lines about its worker: its exitcode line, and its error file's exception line (which
    # also says where that traceback was: its collective, its innermost function)
    error_files = {(f.source, f.exception_line): f for f in failures if f.exception_line is not None}
    entry_rank = {(f.source, f.line): f.rank for f in failures} | {key: f.rank for key, f in error_files.items()}
    workers = [f for f in failures if f.rank is not None]
    entry_time = {(f.source, f.line): f.time for f in failures}
    tasks_are_nodes = srun_tasks_are_nodes(scan, failures)
    findings = []
    chosen = sorted([*primary.values(), *extra], key=lambda h: h.seq)
    records = record_stamps(scan, chosen)
    offsets = clock_offsets(scan, keys)
    for hit in chosen:
        if (scan.block_kinds.get(hit.block_id) == "ignored" or hit.block_id in scan.block_exit_hooks) \
                and hit.rule.role is not Role.CONTEXT:
            continue   # an exception CPython printed and went on from (a __del__, a finalizer at exit)
        if (hit.captures.get("exception_type", "").endswith("Warning")
                and scan.block_kinds.get(hit.block_id) != "traceback"):
            continue   # a warning is raised only at a traceback's end; elsewhere it was printed (its path wrapped)
        stream = keys[scan.slots.final(hit.slot)]
        rank, how = stream.rank_or_none, "stream"
        stamp = hit.stamp or records.get(hit.block_id)
        if stream.kind is StreamKind.LAUNCHER or (rank is None and _WORKER_FIELDS & hit.captures.keys()):
            # a launcher's line about one worker, also when glued to other output
            rank, how = _launcher_rank(hit, entry_rank, workers)
            stamp = entry_time.get((hit.source, hit.line)) or stamp
        if "rank" in hit.captures and hit.captures["rank"].isdigit():
            if not (tasks_are_nodes and SRUN_TASK_NOTICE.match(hit.text)):
                rank, how = int(hit.captures["rank"]), "capture"
        elif rank is None:
            named = next((hit.captures[k] for k in SELF_RANK_CAPTURES if hit.captures.get(k, "").isdigit()), None)
            if named is not None:
                rank, how = int(named), "capture"
        stamp = on_reference_clock(stamp, rank, offsets)
        frame, frame_file = _innermost_frame(scan, hit)
        collective = scan.block_collectives.get(hit.block_id, "")
        site = scan.block_collective_sites.get(hit.block_id, "")
        caller = scan.block_collective_callers.get(hit.block_id, "")
        error_file = error_files.get((hit.source, hit.line))
        if error_file is not None:
            collective, frame, site, caller = error_file.collective, error_file.last_frame, "", ""
        findings.append(Finding(hit.rule, hit.captures, hit.source, hit.line, stream, rank, hit.text,
                                hit.block_id, hit.seq, stamp, how, scan.block_exceptions.get(hit.block_id, ""),
                                collective,
                                scan.block_checkpoint_frames.get(hit.block_id, ""), frame,
                                scan.block_broadcast_sources.get(hit.block_id), frame_file,
                                in_thread=hit.block_id in scan.block_threads, collective_site=site,
                                collective_caller=caller))
    findings = mark_loss_came_back(mark_went_on(_without_source_echoes(findings)), scan, keys)
    findings = one_reading_per_event(findings, scan)
    return attribute_by_signal(findings, failures)


def _without_source_echoes(findings: list[Finding]) -> list[Finding]:
    """A traceback's source line (`    raise FloatingPointError(f"non-finite loss {loss}")`) that a rule
    reads as well as the exception line it raised: the exception line is the event, the code only
    quotes its words."""
    raised = {(f.block_id, f.rule.id) for f in findings if f.block_id >= 0 and exception_type_of(f.text)}
    return [f for f in findings if not (f.block_id >= 0 and (f.block_id, f.rule.id) in raised
                                        and f.text[:1] in " \t" and not exception_type_of(f.text))]


def _innermost_frame(scan: ScanResult, hit: Hit) -> tuple[str, str]:
    """Where the process was when the exception on this line was raised, (function, file): the
    block's innermost frame, or, for the first exception of a chain ("During handling of the
    above exception"), the innermost frame before the chain."""
    cause = scan.block_cause_frames.get(hit.block_id)
    if cause and scan.block_exception_lines.get(hit.block_id) == (hit.source, hit.line):
        return cause, scan.block_cause_files.get(hit.block_id, "")
    return scan.block_last_frames.get(hit.block_id, ""), scan.block_last_files.get(hit.block_id, "")


def _passive(rule: Rule) -> bool:
    """Teardown, context or a warning: what a line also says when it fails is still evidence."""
    return rule.teardown or rule.role is Role.CONTEXT or rule.severity is not Severity.ERROR


# a logged error that says in the same breath that the program goes on without the thing that failed
def _launcher_rank(hit: Hit, entry_rank: dict, workers: list[ChildFailure]) -> tuple[int | None, str]:
    if (hit.source, hit.line) in entry_rank:
        return entry_rank[(hit.source, hit.line)], "launcher"
    pid = hit.captures.get("pid")
    local = next((int(hit.captures[n]) for n in ("local_rank", "process", "task")
                  if hit.captures.get(n, "").isdigit()), None)
    if pid and pid.isdigit():
        named = [w for w in workers if w.pid == int(pid) and (local is None or w.local_rank in (None, local))]
        if named:   # the pid the summary names: exact across nodes, unless two hosts reused it
            return _nearest_summary(hit, named).rank, "launcher"
    if local is not None:
        same_local = [w for w in workers if w.local_rank == local]
        return (_nearest_summary(hit, same_local).rank if same_local else local), "launcher"
    return None, "stream"


def _nearest_summary(hit: Hit, entries: list[ChildFailure]) -> ChildFailure:
    """Of the summary entries that could be this worker's (one per node in a log of many agents),
    the one its own agent printed: the first after the line, else the last before it."""
    after = [e for e in entries if (e.source, e.line) >= (hit.source, hit.line)]
    if after:
        return min(after, key=lambda e: (e.source, e.line))
    return max(entries, key=lambda e: (e.source, e.line))


def attribute_by_signal(findings: list[Finding], failures: list[ChildFailure]) -> list[Finding]:
    """Give an unattributed signal finding the rank of the one worker that died of that signal."""
    by_signal: dict[str, set[int]] = {}
    for failure in failures:
        name = failure.signal or signal_name(failure.exitcode)
        if name and failure.rank is not None:
            by_signal.setdefault(name, set()).add(failure.rank)
    for finding in findings:
        if finding.rank is None:
            continue
        for name, rule_id in _SIGNAL_RULES.items():
            if finding.rule.id == rule_id:
                by_signal.setdefault(name, set()).add(finding.rank)
    out = []
    for finding in findings:
        if finding.rank is None and finding.stream.kind is StreamKind.UNATTRIBUTED:
            for name, rule_id in _SIGNAL_RULES.items():
                ranks = by_signal.get(name, set())
                if finding.rule.id == rule_id and len(ranks) == 1:
                    finding = replace(finding, rank=next(iter(ranks)), attributed_by="signal")
        out.append(finding)
    return out
