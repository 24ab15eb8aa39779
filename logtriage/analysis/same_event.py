"""Several findings that read one event: a traceback's exception and the more specific line a rule
found in it, a logged ERROR record and the traceback logged under it, an exception line whose message a
renderer wrapped onto the next lines, a chained traceback's two exceptions; and a record that says the
program goes on. One reading of each event is kept (analysis/findings.py builds them)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING

from logtriage.catalog.rule import Role
from logtriage.demux.streams import StreamKind

if TYPE_CHECKING:
    from logtriage.analysis.findings import Finding
    from logtriage.scan_result import ScanResult

LOGGED_ERROR = "python.logged_error"
EXIT_ON_THE_WAY_OUT = "signal.terminate_no_exception"
LOSS_NAN = "numerical.loss_nan"   # `loss is nan, skipping step 2`: a step skipped, training goes on
_BLOCK_KINDS_WITH_ONE_EVENT = frozenset({"traceback", "native", "cpp", "fault"})
_RAISE_LINE = re.compile(r"^\s+raise\b")
# `terminate called after throwing ...` only wraps what its `what():` line says: any other error
# read in the same block (a CUDA error, a watchdog timeout) is the event
_WRAPPER_RULES = frozenset({"signal.native_terminate"})


def one_reading_per_event(findings: list[Finding], scan: ScanResult) -> list[Finding]:
    """The findings with one reading kept per event, and the records that say the program goes on
    (and the tracebacks logged under them) marked as gone on from."""
    findings = _logged_going_on(findings, scan.blocks, scan.block_kinds)
    findings = _before_the_handler(findings, scan.block_handling_lines, scan.block_handler_calls_failed)
    findings = _build_reraised(findings)
    return _logged_then_said(_what_below_terminate(_message_wrapped_below(_best_per_traceback(findings,
                                                                                                  scan.block_kinds))))


# torch.utils.cpp_extension's `raise RuntimeError(f"Error building extension '{name}': {compiler output}")
# from` ninja's CalledProcessError: the RuntimeError is what the build raised, with the compiler's words
_NINJA_FAILED = re.compile(r"CalledProcessError: Command '\['ninja'")
_BUILD_RAISED = "Error building extension '"


def _build_reraised(findings: list[Finding]) -> list[Finding]:
    """In a chained traceback holding both, ninja's CalledProcessError yields to the extension build's
    RuntimeError raised from it (the cause is how the build ran, the RuntimeError what failed)."""
    raised = {(f.source, f.block_id) for f in findings if f.block_id >= 0 and _BUILD_RAISED in f.text}
    if not raised:
        return findings
    return [f for f in findings if not ((f.source, f.block_id) in raised and _NINJA_FAILED.search(f.text))]


# (`...; using default 0.5`, `...; using 0.0`: a value put in place of what failed, after a separator)
_GOING_ON = re.compile(r"\b(?:continu(?:e|es|ing)|retry(?:ing)?|will retry|skipp(?:ing|ed)|fall(?:ing)? ?back"
                       r"|ignor(?:e|es|ed|ing)|disabled|without (?:metrics|logging|telemetry|wandb|tensorboard)"
                       r"|rebuild(?:s|ing)?|recreat(?:e|es|ing)|reopen(?:s|ing)?)\b"
                       r"|[;,] (?:using|use) (?:the |a )?(?:defaults?\b|fallback\b|[-+]?\d)", re.IGNORECASE)
# a going-on word the record denies (`refusing to continue`, `cannot continue`, `will not retry`)
_DENIED = re.compile(r"\b(?:refus(?:e|es|ed|ing) to|cannot|can't|can not|unable to|not|won't|will not|no longer"
                     r"|never)\s+$", re.IGNORECASE)
# a record the program logged at WARNING level (`rank 2 WARNING: loader failed ...; rebuilding loader`,
# `[WARNING] ...`, `... - WARNING - ...`): whatever rule its text matches, it says so as a warning
_WARNING_RECORD = re.compile(r"(?:^|[\s\[|-])WARN(?:ING)?\b[\]:]?(?!\S)")


def _logged_going_on(findings: list[Finding], blocks: dict[int, tuple[int, int, int]],
                     block_kinds: dict[int, str]) -> list[Finding]:
    """A record logged at ERROR level, a non-finite loss, or any record logged at WARNING level, that says
    the program carries on (`metrics server unreachable ...; continuing without metrics`, `loss is nan,
    skipping step 2`, `WARNING: loader failed (... Input/output error ...); rebuilding loader`) is no
    failure of the run, and neither is the traceback logged right under it
    (`logger.exception("eval hook failed; continuing")`, `...("hardness lookup failed, using default 0.5")`)."""
    going = {(f.source, f.line): f for f in findings
             if (f.rule.id in (LOGGED_ERROR, LOSS_NAN) or _WARNING_RECORD.search(f.text)) and _says_going_on(f.text)}
    if not going:
        return findings
    out = []
    for f in findings:
        block = blocks.get(f.block_id) if f.block_id >= 0 and block_kinds.get(f.block_id) == "traceback" else None
        record = going.get((block[0], block[1] - 1)) if block is not None and f.is_error else None
        if (f.source, f.line) in going or (record is not None and record.rule.id == LOGGED_ERROR
                                           and record.stream == f.stream):
            f = replace(f, went_on=True)
        out.append(f)
    return out


def _says_going_on(text: str) -> bool:
    return any(not _DENIED.search(text, 0, m.start()) for m in _GOING_ON.finditer(text))


# a handler's error that says what the first exception was: the DataLoader's SIGCHLD handler raising
# `DataLoader worker (pid N) is killed by signal: Killed.` while the main process's fetch of the worker's batch
# had failed with a reset connection (cpu_adhoc 562nd batch)
_SAYS_WHAT_THE_FIRST_WAS = frozenset({"data.loader_worker_died"})


def _before_the_handler(findings: list[Finding], handling: dict[int, int], calls_failed: set[int]) -> list[Finding]:
    """In a traceback chained by "During handling of the above exception, another exception
    occurred", a library usually raises its own, plainer error about the first (a KeyError read as
    "model type not recognised"); but where the same second error also follows a lost peer on another
    rank (a Connection closed by peer handled the same way), it is the handler's own failure (an
    emergency checkpoint into a missing folder, a barrier the others never reach), whatever the
    first exception was: then each such traceback is read by its first exception. So is one whose
    handler failed in a call of its own (`calls_failed`: its innermost frame is not one the first
    exception passed through, as a library's `raise ValueError(...)` in its `except` is)."""
    if not handling:
        return findings
    first: dict[int, list[Finding]] = {}
    then: dict[int, list[Finding]] = {}
    for f in findings:
        if f.block_id in handling and f.is_error and not f.is_teardown:
            (first if f.line < handling[f.block_id] else then).setdefault(f.block_id, []).append(f)
    after_a_lost_peer = {g.rule.id for block, found in first.items() if block in then
                         and all(f.role is Role.CASCADE_CANDIDATE for f in found) for g in then[block]}
    own = {block for block in first.keys() & then.keys()
           if (block in calls_failed or any(g.rule.id in after_a_lost_peer for g in then[block]))
           and not any(g.rule.id in _SAYS_WHAT_THE_FIRST_WAS for g in then[block])}
    if not own:
        return findings
    dropped = {id(g) for block in own for g in then[block]}
    return [f for f in findings if id(f) not in dropped]


LOGGED_RECORD_REACH = 40   # lines of its stream below a logged error that its record's traceback may fill
WRAPPED_MESSAGE_REACH = 3   # lines of its stream below an exception line that its wrapped message may fill


def _logged_then_said(findings: list[Finding]) -> list[Finding]:
    """A record logged at ERROR level (`step failed`) with the traceback under it, each line behind the
    record's own header (a formatter on every line): the error a rule reads in that traceback (a
    consequence too, in a rank's own stream: the record announced its lost peer) says what the record
    only announced;
    the record yields to it. Not to the C++ runtime's `terminate called without an active exception`: that is
    how the process died on its way out after the record (`sys.exit` with a thread still running), no error of
    its own."""
    logged = [f for f in findings if f.rule.id == LOGGED_ERROR and f.is_error]
    return _yield_to_below(findings, logged, LOGGED_RECORD_REACH,
                           lambda g: g.rule.id not in (LOGGED_ERROR, EXIT_ON_THE_WAY_OUT) and not g.is_teardown and (
                               g.role is not Role.CASCADE_CANDIDATE or g.stream.kind is StreamKind.RANK),
                           others_between=False)


def _message_wrapped_below(findings: list[Finding]) -> list[Finding]:
    """An exception line with no message (`RuntimeError: `: a renderer such as rich's traceback wrapped
    the message onto the next lines) says what a rule found in those lines: it yields to that finding
    (gloo's `Timed out waiting 15000ms ...` two lines below)."""
    bare = [f for f in findings if f.rule.id == "python.exception" and not f.captures.get("message", "").strip()
            and f.text.rstrip().endswith(":")]
    return _yield_to_below(findings, bare, WRAPPED_MESSAGE_REACH, lambda g: g.rule.id != "python.exception")


WHAT_REACH = 12   # lines from `terminate called ...` down to its `what():`, with the rank's buffered stdout between


def _what_below_terminate(findings: list[Finding]) -> list[Finding]:
    """`terminate called after throwing an instance of 'gloo::EnforceNotMet'` goes to stderr at once,
    and a rank's buffered stdout can come out between it and its `what():` line (`[default1]:rank 1
    step 2 ...`), so the two are not one block: the `what():` below it in the same stream says what
    was thrown, and the wrapper yields to it as it does within a block."""
    wrappers = [f for f in findings if f.rule.id in _WRAPPER_RULES]
    return _yield_to_below(findings, wrappers, WHAT_REACH, lambda g: "what():" in g.text)


def _yield_to_below(findings: list[Finding], announcing: list[Finding], reach: int, says_more,
                    others_between: bool = True) -> list[Finding]:
    """The findings without each of `announcing` that has, within `reach` lines below it in its own
    stream, an error finding that `says_more` accepts. Without `others_between`, one that another
    stream's error comes between stays: it was said first (a rank that logged its error, then
    took its time, while another rank failed), and it dates its rank's failure."""
    if not announcing:
        return findings

    def interleaved(f: Finding, g: Finding) -> bool:
        return not others_between and any(h.source == f.source and f.line < h.line < g.line and h.stream != f.stream
                                           and h.is_error and not h.is_teardown for h in findings)

    dropped = {id(f) for f in announcing if any(
        g.stream == f.stream and g.source == f.source and 0 < g.line - f.line <= reach
        and g.is_error and says_more(g) and not interleaved(f, g) for g in findings)}
    return [f for f in findings if id(f) not in dropped]


def _best_per_traceback(findings: list[Finding], block_kinds: dict[int, str]) -> list[Finding]:
    """A traceback (or a C++ abort with its `what():` line) is one event: keep its most specific
    error finding (a `Missing key(s)` line explains the generic `RuntimeError: Error(s) in
    loading state_dict` line above it; a watchdog `what():` explains `terminate called`)."""
    best: dict[int, int] = {}
    wrapped: set[int] = set()
    # a Python traceback whose exception a rule knows as a root: an abort printed after it as the
    # process exits (`terminate called without an active exception`: a thread left running) is
    # its aftermath, not a more specific reading of it
    cascade_lines = {(f.block_id, f.line) for f in findings if f.role is Role.CASCADE_CANDIDATE}
    rooted: dict[int, int] = {}     # block -> the line of its exception read as a root
    for f in findings:
        if (f.block_id >= 0 and f.is_error and f.role is Role.ROOT_CANDIDATE
                and block_kinds.get(f.block_id) == "traceback" and (f.block_id, f.line) not in cascade_lines):
            rooted[f.block_id] = min(rooted.get(f.block_id, f.line), f.line)
    for f in findings:
        if f.block_id >= 0 and f.is_error and not f.is_teardown and block_kinds.get(f.block_id) in _BLOCK_KINDS_WITH_ONE_EVENT:
            if f.role is Role.CASCADE_CANDIDATE and f.line > rooted.get(f.block_id, f.line):
                continue
            if f.rule.id in _WRAPPER_RULES:
                best.setdefault(f.block_id, -1)
            else:
                best[f.block_id] = max(best.get(f.block_id, -1), f.rule.priority)
                wrapped.add(f.block_id)
    kept = [f for f in findings
            if not (f.block_id in best and f.is_error and not f.is_teardown
                    and (f.rule.priority < best[f.block_id] or (f.rule.id in _WRAPPER_RULES and f.block_id in wrapped)))]
    # a frame's code line (`raise RendezvousConnectionError(`) names the error too; the exception
    # line of the same block is the one to report
    said = {(f.block_id, f.rule.id) for f in kept if f.block_id >= 0 and not _RAISE_LINE.match(f.text)}
    kept = [f for f in kept if not (_RAISE_LINE.match(f.text) and (f.block_id, f.rule.id) in said)]
    # PEP 479: a StopIteration that leaves a generator becomes `RuntimeError: generator raised
    # StopIteration`, chained after it; that RuntimeError is the exception the rank died of
    converted = {f.block_id for f in kept if f.block_id >= 0 and _STOP_CONVERTED.search(f.text)}
    return [f for f in kept if not (f.block_id in converted and f.captures.get("exception_type", "").startswith("Stop"))]


_STOP_CONVERTED = re.compile(r"RuntimeError: (?:async )?(?:generator|coroutine) raised Stop(?:Async)?Iteration")
