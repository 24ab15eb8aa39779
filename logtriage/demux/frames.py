"""What a traceback's lines say about the process that printed it, gathered while its block is
open: the c10d collective it waited in, its innermost frame (and, for a chained traceback, the
first exception's), a broadcast's source rank, a frame that saves or loads a checkpoint, and
whether it is the launcher's own traceback."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from logtriage.demux import blocks as B

COLLECTIVE_FRAME = re.compile(r'distributed_c10d\.py", line \d+, in (\w+)')
# the calling code's source line of a broadcast: `dist.broadcast(param, src=0)`,
# `broadcast_object_list(objs, src=0)` (frames print their source line under the `File` line)
BROADCAST_SOURCE = re.compile(r'\bbroadcast\w*\(.*\bsrc\s*=\s*(\d{1,9})\b')
# a frame that saves or loads a checkpoint: its function's name, or torch's own serialization code
# or any function of a module, or a package, named for checkpoints (torchbiggraph's
# checkpoint_storage.py, torchtune's training/checkpointing/, ColossalAI's checkpoint_io/)
CHECKPOINT_FRAME = re.compile(
    r', in (\w*(?:checkpoint|ckpt)\w*|(?:save|load)_(?:model|state_dict|pretrained|weights)\w*)\s*$'
    r'|(torch/serialization\.py|torch/distributed/checkpoint/)'
    r'|/(\w*(?:checkpoint|ckpt)\w*\.py)", line \d+, in (\w+)'
    r'|/(\w*(?:checkpoint|ckpt)(?:ing|_io|er)?/(?:\w+/)*\w+\.py)", line \d+, in (\w+)', re.IGNORECASE)
# activation (gradient) checkpointing recomputes a forward pass: not a checkpoint file
ACTIVATION_CHECKPOINT = re.compile(
    r"utils/checkpoint\.py|activation_checkpointing|checkpoint_sequential|CheckpointFunction|"
    r"_checkpoint_without_reentrant|gradient_checkpointing|checkpoint_wrapper|checkpoint_activations", re.IGNORECASE)
# a traceback's frame line: the innermost one says where the process was (waiting, or working);
# one with at most 4 spaces before it and no `Traceback (...)` above starts a cut traceback
FRAME = re.compile(r'^(\s*)File "([^"\n]+)", line \d+, in (\S+)')
LAUNCHER_FRAME = re.compile(
    r'File "[^"]*(?:bin/torchrun|distributed/run\.py|distributed/launch\.py|launcher/api\.py'
    r'|elastic/agent/server/|multiprocessing/spawn\.py"(?:, line \d+, in (?:start_processes|spawn|join)))')


def watch_traceback_line(state: dict, text: str, bare: bool) -> None:
    """Note what one line of an open traceback block says, in the block's `state`."""
    if "distributed_c10d.py" in text:
        m = COLLECTIVE_FRAME.search(text)
        if m:
            state["collective"] = m.group(1)
            if "collective_site" not in state:
                state["collective_site"] = _site(state.get("caller"))
                state["collective_caller"] = _caller(state.get("caller"))
    if "cause_frame" not in state and B.CHAIN.match(text):
        # "During handling of the above exception": the first exception's own innermost frame
        state["cause_frame"] = state.get("last_frame", "")
        state["cause_file"] = state.get("last_file", "")
        if text.startswith("During handling"):
            state["handling"] = None   # its line number comes with Assigner.note_line_number
            state["handler_in"] = frozenset(state.get("functions", ()))
    if "src" in text and "File " not in text:
        m = BROADCAST_SOURCE.search(text)
        if m:
            state["broadcast_src"] = int(m.group(1))
    frame = FRAME.match(text) if ", in " in text else None
    opened = state.pop("call_opened", None)
    if opened is not None and _CARETS.match(text) and len(text) - len(text.lstrip()) > opened:
        state["arguments_failed"] = True   # Python 3.11's markers under the call's arguments, not the call
    if frame is None and state.pop("code_next", False) and text.startswith("    ") and text.strip():
        state["last_code"] = text.strip()   # the innermost frame's source line, where it shows one
        call = _CHECKPOINT_CALL.search(text) if "checkpoint" not in state else None
        if call:
            state["checkpoint"] = call.group(0)   # (its frames below it not shown)
            opened = text.find("(", call.end())
            if call.group(0).startswith("torch.") and opened >= 0:
                state["call_opened"] = opened
    if ", in " in text:
        if frame:
            state.pop("arguments_failed", None)   # (a frame below it: the call ran)
            state["code_next"], state["last_code"] = True, ""
            if "cause_frame" not in state:
                state.setdefault("functions", set()).add(frame.group(3))   # the first exception's frames
            if "last_frame" not in state and frame.group(2).endswith(("threading.py", "weakref.py")):
                # the outermost frame: a thread's run (`Exception in thread X:`), or weakref.finalize's
                # callbacks as the interpreter exits (printed, then the exit goes on with its code)
                state["outermost"] = frame.group(3)
            if "handler_in" in state:
                state["outer_frame"] = state.get("last_frame", "")   # the handler's frame that called the last
            state["last_file"], state["last_frame"] = frame.group(2), frame.group(3)
            if "torch" not in frame.group(2) or not TORCH_FILE.search(frame.group(2)):
                state["caller"] = text   # (read only when a collective's frame follows: _site)
        if "checkpoint" not in state and not ACTIVATION_CHECKPOINT.search(text):
            m = CHECKPOINT_FRAME.search(text)
            if m:
                path, function = (m.group(3), m.group(4)) if m.group(3) else (m.group(5), m.group(6))
                state["checkpoint"] = m.group(1) or m.group(2) or f"{function} ({path})"
    if bare and LAUNCHER_FRAME.search(text):
        state["launcher"] = True


_CLEANUP_FRAMES = frozenset({"__exit__", "__aexit__"})
# a source line that saves or loads a checkpoint itself, or hands a loaded one's entry to a module
# or an optimizer (`opt.load_state_dict(shard["optimizer"])`: as the innermost frame's line, the
# error came from the checkpoint's content, before the call)
_CHECKPOINT_CALL = re.compile(r"\btorch\.(?:load|save)\b|\.load_state_dict\(")
# a source line that calls or computes something: not a `raise` (nor `assert`), and not a caret row
_NOT_A_RAISE = re.compile(r"^(?!raise\b|assert\b|[~^\s]*$)\S")


# a file of torch's own (POSIX or Windows paths); a frame line's file name (its path's last part) and line number
TORCH_FILE = re.compile(r"[/\\]torch[/\\]")
_FRAME_SITE = re.compile(r'File "(?:[^"\n]*[/\\])?([^"/\\\n]*)", line (\d+), in ')


def _caller(frame_line: str | None) -> str:
    """`main` from the frame line of the last frame outside torch before a collective's: the function that called it."""
    m = FRAME.match(frame_line.strip()) if frame_line else None
    return m.group(3) if m else ""


def _site(frame_line: str | None) -> str:
    """`train.py:148` from the frame line of the last frame outside torch before a collective's."""
    m = _FRAME_SITE.search(frame_line) if frame_line else None
    return f"{m.group(1)}:{m.group(2)}" if m else ""
# a caret row: Python 3.11's markers under the part of a source line that raised
_CARETS = re.compile(r"^\s*[~^]+\s*$")


def _load_never_ran(state: dict) -> bool:
    """The innermost frame's own line calls torch.load or torch.save, and Python's markers under it start inside
    the call's parentheses: the error came from computing the call's arguments (`torch.load(f"{WORK}/{REGISTRY[
    pattern]}")` with `~~~~~~~~^^^^^^^^^` under `REGISTRY[pattern]`, KeyError: 'gecko'), so no checkpoint was read
    or written. A traceback cut below the call, or one without markers, keeps the call's reading."""
    return bool(state.get("arguments_failed"))


@dataclass
class TracebackFacts:
    """Per closed traceback block (by block id): what its lines said."""
    exceptions: dict[int, str] = field(default_factory=dict)          # its exception line
    collectives: dict[int, str] = field(default_factory=dict)         # the c10d function it was in
    collective_sites: dict[int, str] = field(default_factory=dict)    # the frame that called it (`train.py:148`)
    collective_callers: dict[int, str] = field(default_factory=dict)  # that frame's function (`main`)
    checkpoint_frames: dict[int, str] = field(default_factory=dict)   # a checkpoint frame
    last_frames: dict[int, str] = field(default_factory=dict)         # its innermost function
    last_files: dict[int, str] = field(default_factory=dict)          # that function's file
    broadcast_sources: dict[int, int] = field(default_factory=dict)   # a broadcast's src rank
    cause_frames: dict[int, str] = field(default_factory=dict)        # a chain's first exception's frame
    cause_files: dict[int, str] = field(default_factory=dict)         # that frame's file
    exception_lines: dict[int, int] = field(default_factory=dict)     # its exception line's number
    # the line "During handling of the above exception, another exception occurred:": what came after
    # it is the handler's own failure (an emergency save, a barrier, a log call that failed)
    handling_lines: dict[int, int] = field(default_factory=dict)
    threads: set[int] = field(default_factory=set)                    # a thread's (not the main program's)
    exit_hooks: set[int] = field(default_factory=set)                 # a finalizer's at interpreter exit
    handler_calls_failed: set[int] = field(default_factory=set)       # see record()

    def record(self, block_id: int, state: dict) -> None:
        if state.get("exception"):
            self.exceptions[block_id] = state["exception"]
        if state.get("collective"):
            self.collectives[block_id] = state["collective"]
            if state.get("collective_site"):
                self.collective_sites[block_id] = state["collective_site"]
            if state.get("collective_caller"):
                self.collective_callers[block_id] = state["collective_caller"]
        if state.get("checkpoint") and not _load_never_ran(state):
            self.checkpoint_frames[block_id] = state["checkpoint"]
        if state.get("last_frame"):
            self.last_frames[block_id] = state["last_frame"]
            self.last_files[block_id] = state["last_file"]
        if state.get("cause_frame"):
            self.cause_frames[block_id] = state["cause_frame"]
            self.cause_files[block_id] = state.get("cause_file", "")
        if "broadcast_src" in state and state.get("collective", "").startswith("broadcast"):
            self.broadcast_sources[block_id] = state["broadcast_src"]
        if state.get("exception_line"):
            self.exception_lines[block_id] = state["exception_line"]
        if state.get("handling"):
            self.handling_lines[block_id] = state["handling"]
        if state.get("outermost") == "_bootstrap_inner":
            self.threads.add(block_id)
        elif state.get("outermost") == "_exitfunc":
            self.exit_hooks.add(block_id)
        handler_in = state.get("handler_in")
        if handler_in and not (state.get("last_frame") in _CLEANUP_FRAMES and state.get("outer_frame") in handler_in) \
                and (state.get("last_frame") not in handler_in or _NOT_A_RAISE.match(state.get("last_code", ""))):
            # the handler's exception was raised in a function the first one never passed through: a
            # call the handler made failed (an emergency save, a barrier), not the handler re-raising
            # (nor the own cleanup of a `with` block the first exception left, whose failure is the same
            # operation's, often plainer; a `with` inside a call the handler made, torch.save's zip writer
            # failing on exit, is that call's failure); or in the same function, on a line that is no `raise`
            # (a `finally:`'s `os.remove(path)`)
            self.handler_calls_failed.add(block_id)
