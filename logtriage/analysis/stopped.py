"""A log with no error the catalog knows, no exit status and no line saying the run finished: its
output simply stops. The issue's rule is that such output is a hang (with each rank's last progress
line), not a healthy run; when its last lines hold an error no rule knows, the run failed of that
error. A log that does not look like a training log at all (binary noise, bare prefixes) stays OK,
since nothing in it says a job ran."""

from __future__ import annotations

import re
from dataclasses import replace

from logtriage.analysis.findings import Finding
from logtriage.analysis.hangs import FINISHED_RULE, fallback_rule
from logtriage.analysis.signed_off import SIGNED_OFF, every_rank_reported_its_result, every_rank_signed_off
from logtriage.analysis.refine import stopped_while_waiting_rule
from logtriage.analysis.roots import RankFacts, RootCause
from logtriage.analysis.timestamps import parse_stamp
from logtriage.catalog.loader import Catalog
from logtriage.catalog.rule import Category
from logtriage.demux.around_paste import environment_report_span, reporters_words
from logtriage.demux.line_marks import OWN_RANK, find_rank_marker
from logtriage.demux.prefixes import Dialect, strip_prefixes
from logtriage.demux.streams import StreamKey
from logtriage.ingest.lines import read_lines
from logtriage.scan_result import STEP, ScanResult, step_number

TailLine = tuple[int, int, str]      # (source, line number, text as read back)
TAIL_LINES = 40
MAX_SOURCES = 64     # a folder of per-rank files: the tails of its last files

# What makes a line a training job's output rather than noise: a log record's stamp or level, or
# the vocabulary of distributed training.
_JOB_OUTPUT = re.compile(
    r"\d{4}-\d\d-\d\d|\d\d:\d\d:\d\d|\b(?:INFO|WARNING|WARN|DEBUG)\b|"
    r"torch|nccl|gloo|cuda|gpu|rank|distributed|deepspeed|lightning|accelerate|epoch|\bstep\b|"
    r"\biter|\bloss\b|train|dataset|dataloader|checkpoint|model|extension|\bops?\b|"
    r"\d%\||\| \d+/\d+ \[",   # a progress bar (tqdm's `96%|...| 61439/64146 [4:33:58<09:36, 4.69it/s]`)
    re.IGNORECASE)
# ProcessGroupNCCL's note that destroy_process_group ran: the program reached its end
_SHUTDOWN = re.compile(r"Process Group shutdown on rank \d+")
# An error line in words any program uses; INFO lines (NCCL's `-> 3` return chain) are not errors,
# and neither is a warning (NCCL's WARN lines count only when they say failed or error).
# (not the second half of a compound: a metric's `TD-error median bin 0/20`, `mean-squared-error 0.41`)
_ERROR_LINE = re.compile(r"(?<!-)\b(?:ERROR|FATAL|FAILED|Error|Fatal|Failed|failed|error|Exception|Aborted|"
                         r"Segmentation fault|core dumped)\b")
_NOT_ERROR = re.compile(r"\bINFO\b|\b(?:no|without|0) errors?\b|Warning\b|\bWARN(?:ING)?\b(?<!NCCL WARN)|"
                        r"\bException ignored in\b", re.IGNORECASE)
_PREFIX_ONLY = re.compile(r"^\s*(?:(?:\[[^\]]{0,40}\]|<std(?:out|err)>|\d{1,7}:):? ?)*$")


def output_stopped(scan: ScanResult, keys: list[StreamKey], tail: list[TailLine], facts: RankFacts,
                   catalog: Catalog) -> RootCause | None:
    """The hang the log's end (`tail`, from log_tail) implies when nothing failed and nothing says
    the run finished."""
    last = next((line for line in reversed(_without_environment_report(tail))
                 if _JOB_OUTPUT.search(line[2]) and not reporters_words(line[2])), None)
    if last is None:
        return None
    messages = [(source, number, message_of(text)) for source, number, text in tail]
    ranked = [(message, _rank_of(scan, keys, source, number, message)) for source, number, message in messages]
    if every_rank_signed_off(ranked, facts) or _ended_on_its_result(scan, keys, tail) or \
            every_rank_reported_its_result(ranked, facts):
        return None
    number = last[1]
    rule = catalog.get("hang.output_stopped") or fallback_rule(
        "hang.output_stopped", Category.HANG, "The output stops: no error, no exit and no line saying the run finished")
    reasons = [f"no error, no exit status and no line saying the run finished: the output stops at line {number}"]
    if facts.last_step:
        low, high = min(facts.last_step.values()), max(facts.last_step.values())
        reasons.append(f"the ranks' last progress lines reached step {low}" if low == high
                       else f"the ranks' last progress lines reached steps {low}-{high}")
    else:
        reasons.append("no progress (step) line was printed: it stopped during start-up or its first steps")
    reasons.append("if the job is still running it is stuck after this line; if it ended, its end is not in this log")
    ranks = tuple(sorted(facts.last_step))
    return RootCause(rule, line_finding(scan, keys, rule, last), None, ranks if len(ranks) > 1 else (), 0.25,
                     tuple(reasons))


# pdsh's `worker-1: ` before a line read back (the demuxer's dialect is not kept with the scan)
PDSH_HOST = re.compile(r"^[\w.-]+: (?=\S)")


def _rank_of(scan: ScanResult, keys: list[StreamKey], source: int, number: int, message: str) -> int | None:
    """The rank a line read back from the log's end belongs to: the script's own `rank N ...` at its start,
    a rank marker in it, else the stream the demuxer gave it."""
    own = OWN_RANK.match(message) or OWN_RANK.match(PDSH_HOST.sub("", message, count=1))
    rank = int(own.group(1)) if own else find_rank_marker(message)
    if rank is None and number - 1 < len(scan.indexes[source].slots):
        rank = keys[scan.slots.final(scan.indexes[source].slots[number - 1])].rank_or_none
    return rank


# a program's own word that it saved its result to a file or a folder (`saved denoiser to /tmp/job/dae_final.pt`,
# `rank 0: saved ckpt/gru.pt`, `exported top-10 to out/topk.pt`, `rank 0 saved export/ after 6 steps`, `rank 0 wrote
# export /tmp/job_work/vole_forecaster_export.pt`, `export written to /tmp/job_work/grader_export.pt`: cpu_adhoc 501st
# and 507th batches); not a framework's record that names its own source (`[engine.py:1818:_save_zero_checkpoint]
# zero checkpoint saved ...`, a save at each interval of a run that goes on), nor a save at a step or epoch
# (`saved ckpt_step200.pt`)
_SAVED = re.compile(r"\b(?:saved|exported|wrote|written)\b"
                    r"(?!.*(?<![a-z0-9])(?:step|epoch|iter(?:ation)?)s?[\s_=:-]*\d).*?"
                    r"(?:[\w.-]*/[\w./-]*\w|\b[\w.-]*\w/(?=\s|$)|"
                    r"\b[\w-]+\.(?:pt|pth|bin|ckpt|safetensors|npy|npz|pkl|onnx|h5|json|csv))",
                    re.IGNORECASE)
# or that it saved, wrote or exported its export or model, with no path (`rank 0 saved export`, `rank 0 wrote till
# classifier export`, `rank 0 exported burrow model`, the last line of a clean run: cpu_adhoc 508th, 566th, 581st batches),
# a summary after a comma allowed (`rank 0 saved export, mean final loss 0.4724`: cpu_adhoc 636th batch) but not a step
_SAVED_EXPORT = re.compile(r"\b(?:saved|wrote|exported)(?:\s+[\w-]+){0,4}?\s+(?:export|model)"
                           r"(?:\s*$|[,;] (?!.*\b(?:step|epoch|iter(?:ation)?)s?\b))", re.IGNORECASE)
_SOURCE_TAG = re.compile(r"\b\w+\.py:\d+\b")
# transformers.Trainer's own log records (`{'loss': '7.154', 'grad_norm': ..., 'epoch': '0.5'}`, and
# `{'train_runtime': '0.4885', ...}` when train() returns): progress with no step number (cpu_adhoc 518th batch)
_TRAINER_RECORD = re.compile(r"^\{['\"](?:loss|eval_loss|train_runtime)['\"]: ")


def _ended_on_its_result(scan: ScanResult, keys: list[StreamKey], tail: list[TailLine]) -> bool:
    """The log's end holds, after progress lines, a rank's line that it saved its result to a file or that it
    is done (`rank 0 done: 5 steps, final global loss 0.11`), that rank said nothing after it, and no other
    rank printed a step after it past the last step printed before it: the program ended (a launcher at its
    default log level prints nothing on success). The other ranks' lines after it are their own last steps or
    results, flushed late."""
    before = -1     # the highest step printed so far
    for at, (source, number, text) in enumerate(tail):
        message = message_of(text)
        ended = (_SAVED.search(message) or _SAVED_EXPORT.search(message) or SIGNED_OFF.search(message)) \
            and not _SOURCE_TAG.search(text)
        if ended and before >= 0:
            rank = _rank_of(scan, keys, source, number, message)
            after = [(s, n, message_of(t)) for s, n, t in tail[at + 1:] if s == source]
            if all(_rank_of(scan, keys, s, n, m) not in (rank, None) and (step_number(m) or 0) <= before
                   for s, n, m in after if m):
                return True
        step = step_number(message)
        if step is None and _TRAINER_RECORD.match(message):
            step = 0
        before = before if step is None else max(before, step)
    return False


def _without_environment_report(tail: list[TailLine]) -> list[TailLine]:
    """The tail without collect_env's report (environment_report_span)."""
    span = environment_report_span([line[2] for line in tail])
    return tail if span is None else tail[:span[0]] + tail[span[1]:]


def stuck_after_warning(tail: list[TailLine], findings: list[Finding]) -> RootCause | None:
    """A log whose job output ends on a warning its program logs before retrying (c10d's `[W
    socket.cpp:601] ... cannot be retrieved (gai error ...)`): the run hangs there, and that
    warning is the likely reason."""
    warned = {(f.source, f.line): f for f in findings if f.logged_as_warning}
    for source, number, text in reversed(tail):
        finding = warned.get((source, number))
        if finding is not None:
            return RootCause(finding.rule, finding, finding.rank, (finding.rank,) if finding.rank is not None else (),
                             0.3, (f"the output stops at line {number}, a warning its program logs before it retries: "
                                   "if the job did not go on, it is stuck retrying, and this is the likely reason",))
        if _JOB_OUTPUT.search(text):
            return None
    return None


def unknown_error_line(scan: ScanResult, keys: list[StreamKey], tail: list[TailLine],
                       catalog: Catalog, known: frozenset[tuple[int, int]] = frozenset()) -> RootCause | None:
    """The first line of the log's end (`tail`) that says error in plain words when no error rule
    matched anything: the run failed of an error the catalog does not know. A line a rule reads
    (`known`: source, line) is not unknown, even when that rule calls it harmless."""
    by_source: dict[int, list[TailLine]] = {}
    for t in tail:
        by_source.setdefault(t[0], []).append(t)
    line = None
    for own in by_source.values():     # log_tail lists the inputs in order
        progress = max((i for i, t in enumerate(own) if STEP.search(t[2])), default=-1)
        line = next((t for t in own[progress + 1:]     # progress after an error: the run went on
                     if _ERROR_LINE.search(t[2]) and not _NOT_ERROR.search(t[2]) and not reporters_words(t[2])
                     and (t[0], t[1]) not in known),
                    None)
        if line is not None:
            break
    if line is None:
        return None
    rule = catalog.get("unknown.error_line") or fallback_rule(
        "unknown.error_line", Category.UNKNOWN, "An error line no rule knows, and nothing after it")
    finding = line_finding(scan, keys, rule, line)
    return RootCause(rule, finding, finding.rank, (finding.rank,) if finding.rank is not None else (), 0.3, (
        f"line {line[1]} reports an error no rule in the catalog knows, and nothing after it says the run went "
        "on or finished: read it as the failure",))


def line_finding(scan: ScanResult, keys: list[StreamKey], rule, line: TailLine) -> Finding:
    source, number, text = line
    stream = keys[scan.slots.final(scan.indexes[source].slots[number - 1])]
    return Finding(rule, {}, source, number, stream, stream.rank_or_none, message_of(text), -1, scan.seq + 1, None)


def message_of(text: str) -> str:
    """A line read back from the input, as a finding's text: launcher prefixes stripped."""
    return strip_prefixes(text, Dialect()).text.strip()


def log_tail(scan: ScanResult, findings: list[Finding], facts: RankFacts) -> list[TailLine]:
    """The last lines of each input (of a folder: its last MAX_SOURCES files), (source, line,
    text) with text in them, or none when the input broke off or the log says the run finished."""
    if scan.unreadable or facts.completed or any(f.rule.id == FINISHED_RULE or _SHUTDOWN.search(f.text)
                                                  for f in findings):
        return []
    tail: list[TailLine] = []
    for source in range(max(0, len(scan.sources) - MAX_SOURCES), len(scan.sources)):
        total = len(scan.indexes[source].offsets)
        numbers = list(range(max(1, total - TAIL_LINES + 1), total + 1))
        texts = read_lines(scan.sources[source], scan.indexes[source], numbers) if numbers else {}
        tail += [(source, n, texts.get(n, "")) for n in numbers if not _PREFIX_ONLY.match(texts.get(n, ""))]
    return tail


STORE_CONNECT_RULES = frozenset({"dist.store_connect_timeout", "dist.store_connect_failed"})
# c10d's TCPStore client between attempts (`TCP client failed to connect/validate to host ... -
# retrying (try=0, timeout=600000ms, delay=33924ms): ...`) and the C++ frames printed under it
_RETRYING = re.compile(r"- retrying \(try=\d+")
_NATIVE_TRAILER = re.compile(r"Exception raised from |^\s*frame #\d+|^\s*$")


def still_retrying(scan: ScanResult, root: RootCause, findings: list[Finding]) -> bool:
    """The only errors are a store client's failed connects, and the log ends on its note that it
    will try again: the process was still retrying when the output stops, so the run hangs there
    (a store host that is gone or unreachable), it has not failed yet."""
    if root.rule.id not in STORE_CONNECT_RULES or scan.unreadable or not scan.sources:
        return False
    if any(f.is_error and not f.is_teardown and f.rule.id not in STORE_CONNECT_RULES for f in findings):
        return False
    source = len(scan.sources) - 1
    total = len(scan.indexes[source].offsets)
    numbers = list(range(max(1, total - 7), total + 1))
    texts = read_lines(scan.sources[source], scan.indexes[source], numbers)
    for number in reversed(numbers):
        text = texts.get(number, "")
        if _RETRYING.search(text):
            return True
        if not _NATIVE_TRAILER.search(text):
            return False
    return False


LAUNCHER_STOP_RULES = frozenset({"launcher.signal_exception", "launcher.interrupted"})
STALL_SECONDS = 600.0
_CTRL_C = re.compile(r"^(?:\^C)+")


def stalled_before_stop(scan: ScanResult, root: RootCause, findings: list[Finding], catalog: Catalog) -> RootCause:
    """A launcher stopped by a signal (Ctrl-C, a scheduler's SIGTERM) whose output before the stop
    ends on a stamped line ten minutes or more earlier, with no error since: the job had stalled,
    and the stop only ended the hang (axolotl#1563: `Starting trainer...` at 21:39, Ctrl-C at 22:04)."""
    stop = root.finding
    if root.rule.id not in LAUNCHER_STOP_RULES or stop is None or stop.source >= len(scan.sources):
        return root
    end = stop.stamp or parse_stamp(_CTRL_C.sub("", stop.text))
    if end is None:
        return root
    numbers = list(range(max(1, stop.line - 40), stop.line))
    texts = read_lines(scan.sources[stop.source], scan.indexes[stop.source], numbers)
    last = next(((n, texts[n]) for n in reversed(numbers) if texts.get(n, "").strip()), None)
    begin = parse_stamp(_CTRL_C.sub("", message_of(last[1]))) if last else None
    if begin is None or begin.family != end.family or end.seconds - begin.seconds < STALL_SECONDS:
        return root
    if any(f.fails_beyond_a_stop and f.source == stop.source and last[0] <= f.line < stop.line for f in findings):
        return root
    rule = stopped_while_waiting_rule(catalog)
    minutes = (end.seconds - begin.seconds) / 60
    return replace(root, rule=rule, confidence=min(root.confidence, 0.45), reasons=root.reasons + (
        f"the last output before the stop (line {last[0]}) is stamped {minutes:.0f} minutes earlier, and nothing "
        "failed since: the job had stalled there, and the stop only ended the hang",))

