"""Multi-line blocks and the grammar of their continuation lines.

A block starts with a recognisable first line and continues while lines fit its grammar; every
line of a block goes to the block's stream. Blocks whose first line carries no rank (a bare
traceback) get their owner decided when they end (see assigner)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

from logtriage.demux.launcher import MPI_NOTICE_SIGNAL


class BlockKind(str, Enum):
    TRACEBACK = "traceback"
    CPP = "cpp"                # C++ glog message with bare continuation / frame lines
    CHILD_FAILED = "child_failed"
    BANNER = "banner"
    FAULT = "fault"            # faulthandler dump
    NATIVE = "native"          # terminate called ... / what():
    WARNING = "warning"        # path:N: XWarning: msg + indented source line
    MPI_NOTICE = "mpi_notice"  # Open MPI's "noticed that process rank N ... exited on" + "signal 9 (Killed)."
    IGNORED = "ignored"        # "Exception ignored in: <function X.__del__ ...>" + the traceback CPython goes on after
                               # (also logging's "--- Logging error ---")


TRACEBACK_START = re.compile(r"^Traceback \(most recent call last\):\s*$")
# CPython's header for an exception it prints and ignores (a finalizer, an atexit hook, a thread
# at shutdown): the traceback under it did not end the process
# (also the logging module's `--- Logging error ---`: a handler failed to write a record, printed
# the traceback and the call stack, and the program went on)
IGNORED_START = re.compile(r"^(?:Exception ignored (?:in|on)\b|--- Logging error ---\s*$"
                           r"|Error in atexit\._run_exitfuncs:\s*$)")
# what the logging module prints under a handler's failed record's traceback
_LOGGING_TAIL = re.compile(r"^(?:Call stack:|Message: |Arguments: )")
# a chained traceback's link: what follows is the next exception of the chain
CHAIN = re.compile(r"^(?:During handling of the above exception, another exception occurred:"
                   r"|The above exception was the direct cause of the following exception:)\s*$")
# An exception line's head, its type in group 1 (`NameError: name ...`, `torch.OutOfMemoryError: ...`,
# a bare `MemoryError`): what closes a traceback, also an error file's in a launcher summary. NCCL's
# result codes inside a DistBackendError's message (`ncclInternalError: Internal check failed.`) are not.
# pynvml names its errors by code: `pynvml.nvml.NVMLError_NotSupported: Not Supported`. A module's own
# base class may be a bare `Error` (`lmdb.Error: ...`), named with its module.
# (and a class of a module of exceptions whatever its name ends with: dynamo's `torch._dynamo.exc.Unsupported`,
# `torch._dynamo.exc.BackendCompilerFailed`)
EXCEPTION_HEAD = re.compile(r"^(?!nccl[A-Z])((?:[A-Za-z_]\w*\.)*(?:[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)"
                            r"|Exception|[A-Za-z_]\w*Error_[A-Z]\w*)|(?:[A-Za-z_]\w*\.)+Error"
                            r"|(?:[A-Za-z_]\w*\.)*_?(?:exc|exceptions|errors)\.[A-Z]\w*)(?::|$)")
EXCEPTION_LINE = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)(?::(?: (?P<message>.*))?)?$")
# NCCL's own line header with NCCL_DEBUG set: `host:pid:tid [cudaDev] ` (the host and pid name one process)
NCCL_PREFIX = re.compile(r"^([\w.-]{1,64}):(\d{1,12}):\d{1,12} \[\d{1,4}\] ")
CPP_GLOG = re.compile(r"^\[([IWEF])(\d{3,4}) (\d\d:\d\d:\d\d\.\d{3,9})(?: \d+)? ([^ \]]+):(\d+)\] ")
_CPP_CONT = re.compile(r"^(?:Exception raised from |frame #\d+: |<omitting python frames>|\s)")
FAULT_START = re.compile(r"^Fatal Python error: ")
_FAULT_CONT = re.compile(r"^(?:\s|Current thread 0x|Thread 0x|Extension modules: |Python runtime state: "
                         r"|Stack \(most recent call first\)|\(total: \d+\)|<no Python frame>)")
NATIVE_START = re.compile(r"^terminate called (?:after throwing an instance of|without an active exception|recursively)")
_NATIVE_CONT = re.compile(r"^(?:\s+what\(\): |Exception raised from |frame #\d+: |<omitting python frames>)")
WARNING_START = re.compile(r"^\S.*?:\d+: [A-Z]\w*Warning: ")
BANNER_TITLE = re.compile(r"^== (.{2,60}) ==\s*$")
BANNER_RULE = re.compile(r"^={5,}\s*$")
_BANNER_CONT = re.compile(
    r"^(?:\s|={5,}|== .* ==|NVIDIA Release |PyTorch Version |Container image |Copyright |All rights reserved"
    r"|Various files include |This container image |By pulling and using |https?://|NOTE: |WARNING: |ERROR: "
    r"|NVIDIA |Use the NVIDIA |insufficient |Failed to detect NVIDIA driver|\*)")


def continues(kind: BlockKind, text: str, state: dict) -> bool:
    """Whether `text` (prefixes already stripped) continues an open block of `kind`. `state` is
    the block's own scratch space (e.g. whether a traceback reached its exception line)."""
    if kind is BlockKind.TRACEBACK:
        return _continues_traceback(text, state)
    if kind is BlockKind.CHILD_FAILED:
        return _continues_child_failed(text, state)
    if kind is BlockKind.IGNORED:
        if not state.get("traceback"):
            state["traceback"] = bool(TRACEBACK_START.match(text))
            return state["traceback"]
        if state.get("logging_tail") or _LOGGING_TAIL.match(text):
            # logging's record under its traceback: `Call stack:`, the caller's frames, `Message: `, `Arguments: `
            if state.get("logging_tail") == "done":
                return False
            state["logging_tail"] = "done" if text.startswith("Arguments: ") else True
            return text.startswith((" ", "\t")) or bool(_LOGGING_TAIL.match(text))
        return _continues_traceback(text, state)
    if not text:
        if kind is BlockKind.CPP:
            state["ended"] = True
            return True
        return kind in (BlockKind.FAULT, BlockKind.BANNER)
    if state.get("ended"):
        return False
    if kind is BlockKind.CPP:
        return bool(_CPP_CONT.match(text))
    if kind is BlockKind.FAULT:
        return bool(_FAULT_CONT.match(text)) or text.startswith("  File ")
    if kind is BlockKind.NATIVE:
        return bool(_NATIVE_CONT.match(text))
    if kind is BlockKind.WARNING:
        return text.startswith((" ", "\t"))
    if kind is BlockKind.MPI_NOTICE:
        state["ended"] = True
        return bool(MPI_NOTICE_SIGNAL.match(text))
    if kind is BlockKind.BANNER:
        return bool(_BANNER_CONT.match(text))
    return False


MAX_MESSAGE_LINES = 40
_NEW_RECORD = re.compile(r"^(?:\[?[IWEFC]\d{4} \d\d:|\[?\d{4}-\d\d-\d\d[ T_]|\S+\.py:\d+: \w*Warning:|[A-Z][A-Z0-9_]*_JSON=)")
_MESSAGE_DETAIL = re.compile(r"^(?:nccl[A-Z]\w*: |Last error:|NCCL version )")
# A paste that lost its indentation: `File "x.py", line 3, in f` at column 0, then the code line.
_BARE_FRAME = re.compile(r'^File "[^"]*", line \d+')
_CARETS = re.compile(r"^[\^~ ]+$")
_TYPE_NAME = re.compile(r"^(?:\w+\.)+\w+$|(?:Error|Exception|Interrupt|Exit|Warning)$")


def _continues_traceback(text: str, state: dict) -> bool:
    if not text:
        state["blank"] = True
        return True  # blank lines inside messages and between chained tracebacks
    blank_before = state.pop("blank", False)
    if TRACEBACK_START.match(text) or CHAIN.match(text):
        if state.get("message") and not (blank_before or CHAIN.match(text)):
            return False
        state["message"] = False
        return True
    if text[0] in " \t":
        return True  # frames, source lines, carets, indented message continuation
    if not state.get("message"):
        after = state.pop("bare", None)
        if _BARE_FRAME.match(text):
            state["bare"] = "frame"
            return True
        if after == "frame":
            m = EXCEPTION_LINE.match(text)
            if not (m and _TYPE_NAME.search(m.group("type"))):
                state["bare"] = "code"
                return True  # the frame's code line
        elif after == "code" and _CARETS.match(text):
            return True
    if state.get("message"):
        # Multi-line exception messages: under a rank prefix every line of the message keeps the
        # prefix (one write per traceback); bare, only NCCL's detail lines are recognisable.
        lines = state.get("message_lines", 0)
        after_last_error = state.pop("last_error", False)
        # (the C++ runtime's abort and CPython's fatal error that follow a traceback are their own blocks:
        # `[trainer5]:terminate called after throwing ...` under the same prefix as the message)
        if lines < MAX_MESSAGE_LINES and not _NEW_RECORD.match(text) and not NATIVE_START.match(text) \
                and not FAULT_START.match(text) and (
                (state.get("prefixed") and state.get("line_prefixed")) or after_last_error
                or state.get("empty_head") or _MESSAGE_DETAIL.match(text)):
            state["message_lines"] = lines + 1
            state["last_error"] = text.startswith("Last error:")
            return True
        return False
    if not EXCEPTION_LINE.match(text):
        return False  # not an exception line: someone else's output, the block is over
    state["message"] = True  # the exception line
    state["exception"] = text
    # `AssertionError: ` with the message on the lines below it (torch 1.x's driver check)
    # (an `...Error:` only: mp.spawn's `ProcessRaisedException: ` is followed by the child's report)
    state["empty_head"] = text.rstrip().endswith("Error:")
    return True


def _continues_child_failed(text: str, state: dict) -> bool:
    """Everything up to the closing `=====` border after the Root Cause section; for a summary
    whose header the paste cut off, the error file's traceback indented under its field."""
    if state.get("closed"):
        return False
    if state.get("field_traceback"):
        frame_or_code = text.startswith("   ")          # `    File ...`, `      code`
        exception = text.startswith("  ") and EXCEPTION_HEAD.match(text.strip()) is not None
        return frame_or_code or exception
    if BANNER_RULE.match(text):
        if state.get("root"):
            state["closed"] = True
        return True
    if text.startswith("Root Cause"):
        state["root"] = True
    return True


# What the assigner keeps of an open block, and what it hands out for each line
@dataclass
class Block:
    kind: BlockKind
    slot: int
    block_id: int
    bare: bool                       # owner decided at the end (slot is a BLOCK slot)
    state: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Part:
    slot: int
    text: str                        # message with prefixes stripped
    block_id: int                    # -1 outside blocks


def resumable(block: Block) -> bool:
    """A prefixed stream's native abort, or its traceback before its exception line: another
    stream's lines between its lines do not end it (after the exception line, a message's
    continuation could not be told from the stream's next output)."""
    if not block.state.get("explicit"):
        return False
    return block.kind is BlockKind.NATIVE or (block.kind is BlockKind.TRACEBACK and not block.state.get("exception"))
