"""An exception's type read from the line that prints it, wherever a tool put it: behind a glog or a
logger's header, in pytest's summary, in an error file's message, at the end of a JSON record's escaped
traceback, as a repr; and names as several ranks' copies glued them, or without their module."""

from __future__ import annotations

import re
import sys

from logtriage.demux.blocks import EXCEPTION_HEAD
from logtriage.demux.launcher import PY_GLOG

_GLUED_NAME = re.compile(r"([\w.]{4,}?)\1+")
# pytest's short test summary: `FAILED tests/test_x.py::test_y - RuntimeError: ...`
_PYTEST_SUMMARY = re.compile(r"^(?:FAILED|ERROR) \S+::\S+ - ")
# torchelastic's error file, as its error handler logs it: `  "message": "RuntimeError: ...",`
_ERROR_FILE_MESSAGE = re.compile(r'^\s*"message": "')
# an exception printed by its repr: `RuntimeError('CUDA error: invalid device ordinal...')`
_EXCEPTION_REPR = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception))\(['\"]")
_VLLM_LOGGER = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[?[\w.-]+\.py:\d+\] ")


def exception_type_of(text: str) -> str | None:
    """`torch.OutOfMemoryError` of `torch.OutOfMemoryError: CUDA out of memory...`, else None;
    also after Markdown emphasis (`**OSError: ...**`), the agent's glog header (`E0422 05:07:49.013000
    204 .../api.py:732] RuntimeError: ...`) or vLLM's logger header (`ERROR 10-14 12:32:47
    multiproc_worker_utils.py:233] torch.OutOfMemoryError: ...`) or a logging record's time and level
    (`2026-12-02 21:39:13,183 ERROR   [rank 7] FloatingPointError: ...`) or in pytest's short summary
    (`FAILED tests/test_x.py::test_y - RuntimeError: ...`), in an error file's `"message"` field, at
    the end of a JSON log record's escaped traceback, or as the exception's repr (`RuntimeError('...')`)."""
    glog = PY_GLOG.match(text)
    if glog:
        text = glog.group(7)
    else:
        logger = (_VLLM_LOGGER.match(text) or _PYTEST_SUMMARY.match(text) or _ERROR_FILE_MESSAGE.match(text)
                  or _LOGGING_HEADER.match(text))
        text = text[logger.end():] if logger else text
    text = text.lstrip(" \t").lstrip("*_`")   # indented: an error file's, in the launcher's summary
    if text[:1] == "{":
        m = _JSON_TRACEBACK_END.search(text)
        if m:
            return unglued(m.group(1))
    m = EXCEPTION_HEAD.match(text) or _EXCEPTION_REPR.match(text)
    if not m:
        return None
    wrapped = _CALLBACK_WRAPPER.search(text)
    while wrapped is not None and (inner := EXCEPTION_HEAD.match(text[wrapped.end():])) is not None:
        m, text = inner, text[wrapped.end():]        # the exception the callback itself raised
        wrapped = _CALLBACK_WRAPPER.search(text)
    return unglued(m.group(1))


# torch.futures' wrapper around an exception a Future's callback (`.then(...)`, a DDP comm hook's)
# raised: `RuntimeError: Got the following error when running the callback: KeyError: 'Train'`
CALLBACK_WRAPPED = "Got the following error when running the callback: "
_CALLBACK_WRAPPER = re.compile(r"^[\w.]+: " + CALLBACK_WRAPPED)


# a logging record's time and level (and a script's rank label) in front of each line of a traceback it logged
_LOGGING_HEADER = re.compile(r"^\[?\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?\]?\s+(?:-\s+)?(?:[\w.]+\s+-\s+)?"
                             r"(?:ERROR|CRITICAL|FATAL)\s+(?:-\s+)?(?:\[rank ?\d+\]\s+)?")
# a JSON log record's traceback, one escaped string: its last line, the one that ends the string
_JSON_TRACEBACK_END = re.compile(r'\\n((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Failure|Fault|Interrupt|Iteration))'
                                 r'(?::(?:[^"\\]|\\[^n])*)?(?:\\n)?"')


def unglued(name: str) -> str:
    """One exception name of several ranks' copies written at once (`RuntimeErrorRuntimeError`)."""
    glued = _GLUED_NAME.fullmatch(name)
    return glued.group(1) if glued else name


def short_type(name: str | None) -> str | None:
    """`torch.cuda.OutOfMemoryError` -> `OutOfMemoryError`."""
    return name.rsplit(".", 1)[-1] if name else None


# `cannot import name 'Queue' from 'queue' (/job/queue.py)` (partially initialized, too): the module and its file
_IMPORTED_FROM = re.compile(r"cannot import name '[^']+' from (?:partially initialized module )?'([A-Za-z_]\w*)' "
                            r"(?:\(most likely due to a circular import\) )?\(([^()]+)\)")
# a file of an installed package (a framework's, a library's), not the job's own: its top-level package in group 1
INSTALLED_PACKAGE = re.compile(r"[/\\](?:site|dist)-packages[/\\]([A-Za-z_]\w*)")
# where Python's own modules and installed packages live
_LIBRARY_DIR = re.compile(r"[/\\](?:site|dist)-packages[/\\]|[/\\]lib(?:64)?[/\\]python\d|[/\\]Lib[/\\]|^<")


def shadowing_file(text: str) -> str:
    """The job's own file that an ImportError names where a standard-library module's should be ('' otherwise)."""
    m = _IMPORTED_FROM.search(text)
    if m is None or m.group(1) not in sys.stdlib_module_names or _LIBRARY_DIR.search(m.group(2)):
        return ""
    path = m.group(2).replace("\\", "/")
    return path if path.endswith((f"/{m.group(1)}.py", f"/{m.group(1)}/__init__.py")) else ""
