"""Hypothesis strategies that build log-like bytes: real torchrun shapes, mangled.

A log is a list of lines joined by `\\n` (sometimes `\\r\\n`, sometimes without a final newline).
Each line is a message (a real line from `sample_logs/`, a traceback piece, a ChildFailedError
fragment, a glog header, a step line) under zero or more launcher prefixes (`[rank3]: `,
`[default0]:`, `3: `, `[1,3]<stdout>:`, `host-1: `), optionally glued to another rank's line and
optionally damaged (ANSI and OSC sequences, `\\r` redraws, NUL, invalid UTF-8, Latin-1, bidi
overrides, a cut in the middle). Pure random bytes are mixed in too, but most examples look like
logs, so the demuxer's prefix, block and splitting paths are the ones exercised.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from hypothesis import strategies as st

SAMPLES = Path(__file__).resolve().parents[2] / "sample_logs"

RANKS = st.one_of(st.integers(0, 7), st.integers(0, 10_000), st.integers(2**31 - 2, 2**31 + 2),
                  st.integers(2**32, 10**12))

MESSAGES = (
    "Traceback (most recent call last):",
    '  File "/tmp/train.py", line 42, in <module>',
    "    main(args)",
    "    ^^^^^^^^^^",
    "KeyError: 'target'",
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500",
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
    "Timed out waiting 10000ms for recv operation to complete",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB",
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    "============================================================",
    "train.py FAILED",
    "------------------------------------------------------------",
    "Failures:",
    "[1]:",
    "  <NO_OTHER_FAILURES>",
    "Root Cause (first observed failure):",
    "[0]:",
    "  time      : 2026-11-30_01:06:31",
    "  host      : localhost",
    "  rank      : 1 (local_rank: 1)",
    "  exitcode  : -6 (pid: 19986)",
    "  error_file: <N/A>",
    "  traceback : Signal 6 (SIGABRT) received by PID 19986",
    "E1130 01:06:31.524000 19577 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) "
    "local_rank: 1 (pid: 19986) of binary: /usr/bin/python",
    "W1130 01:06:31.492000 19577 torch/distributed/elastic/multiprocessing/api.py:1028] "
    "Sending process 19985 closing signal SIGTERM",
    "[E1130 00:01:08.161225451 ProcessGroupGloo.cpp:143] Rank 1 successfully reached monitoredBarrier",
    "[W1130 00:01:08.161225 reducer.cpp:132] Reducer initialized",
    "Exception raised from recvBytes at ../torch/csrc/distributed/c10d/Utils.hpp:670 (most recent call first):",
    "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x96 (0x7f in libc10.so)",
    "terminate called after throwing an instance of 'gloo::EnforceNotMet'",
    "  what():  [enforce fail at ../gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes. 64 vs 32",
    "Fatal Python error: Aborted",
    "Current thread 0x00007f (most recent call first):",
    "[rank 0] step 3 loss 0.0750",
    "step 12 loss nan grad_norm nan",
    " 40%|####      | 4/10 [00:01<00:01,  3.90it/s]",
    "-- Process 1 terminated with the following error:",
    "LOGTRIAGE_ENVIRONMENT_JSON={\"torch\": \"2.13.0\"}",
    "== PyTorch ==",
    "WARNING:torch.distributed.elastic.multiprocessing.api:Sending process 3 closing signal SIGTERM",
    "srun: error: node-3: task 3: Exited with exit code 1",
    "/usr/lib/python3/site-packages/torch/distributed/launch.py:181: FutureWarning: The module is deprecated",
    "[rank1]: [rank",
    "[rank",
    "",
    "   ",
)

DAMAGE = (
    "\x1b[31m", "\x1b[0m", "\x1b[2J", "\x1b]0;title\x07", "\x1b]8;;http://x\x1b\\", "\x1b", "\x07", "\x9b",
    "\r", "\r\r", "\x00", "\x00\x00\x00", "\u202e", "\u2066", "\ud800", "|", "`", "<script>", "]", "[",
)
RAW_DAMAGE = (b"\xff", b"\xe9", b"\xc3", b"\xe2\x80", b"\xed\xa0\x80", b"\xf0\x9f\x98", b"\x1f\x8b")


@lru_cache(maxsize=1)
def real_lines() -> tuple[str, ...]:
    """A few thousand distinct lines from the captured sample logs (real shapes, real prefixes)."""
    seen: dict[str, None] = {}
    for path in sorted(SAMPLES.rglob("*.log")):
        for line in path.read_bytes().decode("utf-8", "replace").splitlines():
            if len(line) < 400:
                seen.setdefault(line, None)
        if len(seen) > 4000:
            break
    return tuple(seen) or MESSAGES


def _prefix(kind: str, rank: int, host: str) -> str:
    return {
        "excepthook": f"[rank{rank}]: ",
        "excepthook_tight": f"[rank{rank}]:",
        "tee": f"[default{rank % 10_000_000}]:",
        "tee_role": f"[trainer{rank % 10_000_000}]:",
        "tee_host": f"[{host}:{rank % 10_000_000}]:",
        "srun": f"{rank % 10_000_000}: ",
        "mpi": f"[1,{rank}]<stdout>:",
        "mpi_err": f"[1,{rank}]<stderr>: ",
        "template": f"[default|rank={rank}|local={rank % 8}] ",
        "host": f"{host}: ",
        "user": f"[rank {rank}] ",
        "garbled": "[rank",
    }[kind]


PREFIX_KINDS = st.sampled_from(("excepthook", "excepthook_tight", "tee", "tee_role", "tee_host", "srun", "mpi",
                                "mpi_err", "template", "host", "user", "garbled"))


@st.composite
def messages(draw) -> str:
    source = draw(st.integers(0, 9))
    if source < 4:
        return draw(st.sampled_from(MESSAGES))
    if source < 8:
        return draw(st.sampled_from(real_lines()))
    return draw(st.text(max_size=60))


@st.composite
def prefixed_lines(draw) -> str:
    message = draw(messages())
    layers = draw(st.lists(st.tuples(PREFIX_KINDS, RANKS), max_size=3))
    host = draw(st.sampled_from(("node-1", "gpu187", "worker-3", "h")))
    return "".join(_prefix(kind, rank, host) for kind, rank in layers) + message


@st.composite
def damaged_lines(draw) -> bytes:
    text = draw(prefixed_lines())
    if draw(st.booleans()):  # glue another rank's output onto this one
        text = text[: draw(st.integers(0, len(text)))] + draw(prefixed_lines())
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(DAMAGE)) + text[at:]
    raw = text.encode("utf-8", "surrogatepass")
    if draw(st.integers(0, 4)) == 0:
        raw = text.encode("latin-1", "replace")
    for _ in range(draw(st.integers(0, 2))):
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.sampled_from(RAW_DAMAGE)) + raw[at:]
    if draw(st.integers(0, 9)) == 0:
        raw = raw[: draw(st.integers(0, len(raw)))]  # a cut, as when the writer was killed
    return raw.replace(b"\n", b" ")


LINE = st.one_of(damaged_lines(), damaged_lines(), damaged_lines(),
                 st.binary(max_size=80).map(lambda b: b.replace(b"\n", b"")))


@st.composite
def log_bytes(draw, max_lines: int = 60) -> bytes:
    """A whole log: lines joined by \\n or \\r\\n, sometimes without the last newline, sometimes raw bytes."""
    if draw(st.integers(0, 19)) == 0:
        return draw(st.binary(max_size=400))
    lines = draw(st.lists(LINE, max_size=max_lines))
    ending = draw(st.sampled_from((b"\n", b"\n", b"\r\n")))
    data = ending.join(lines)
    if lines and draw(st.booleans()):
        data += ending
    return data


def physical_lines(data: bytes) -> list[bytes]:
    """The file's physical lines as the tool must count them: split at \\n, a final unterminated
    line counts, an empty file has none."""
    if not data:
        return []
    parts = data.split(b"\n")
    if data.endswith(b"\n"):
        parts.pop()
    return parts


@st.composite
def inflated_logs(draw) -> bytes:
    """Real lines whose every number is blown up to 19, 30 or 5000 digits: no rank, pid or exit
    code may crash int() or overflow the JSON report's 64-bit integers."""
    with_digits = [line for line in real_lines() if any(c.isdigit() for c in line)]
    lines = draw(st.lists(st.sampled_from(with_digits), min_size=1, max_size=40))
    digits = draw(st.sampled_from((19, 30, 5000)))
    return "\n".join(re.sub(r"\d+", "9" * digits, line) for line in lines).encode()
