"""The assigner's reading of a line with no prefix that names its process: the launcher's own
line shapes, a probe, a banner, a traceback's start, a rank marker in the text, else unattributed.

A mixin of `Assigner` (assigner.py): it reads and sets the assigner's state (the open block, the
slot table, the launcher facts) and opens blocks with the assigner's `_open`."""

from __future__ import annotations

import re

from logtriage.demux import blocks as B
from logtriage.demux import launcher as L
from logtriage.demux.blocks import Part
from logtriage.demux.frames import FRAME
from logtriage.demux.line_marks import PROBE, block_start, find_rank_marker
from logtriage.demux.streams import StreamKind

# (NCCL's result codes under a DistBackendError, `ncclInternalError: Internal check failed.`, are
# part of its message, not exceptions)
EXCEPTION_START = re.compile(r"^(?!nccl[A-Z])(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception): ")
ERROR_RECORD = re.compile(r"\b(?:ERROR|CRITICAL|FATAL|Exception|exception)\b")


class UnprefixedLines:
    """Where a line goes when no prefix names its process."""

    def _unprefixed(self, text: str) -> Part:
        slots = self.slots
        if not text.strip():
            return self._part(self.last_slot, text)
        launcher = slots.fixed(StreamKind.LAUNCHER)
        glog = L.py_glog_pid(text)
        if glog is not None:
            pid, path = glog
            if L.is_launcher_path(path) or pid in self.facts.launcher_pids or not self.facts.launcher_pids:
                self.facts.launcher_pids.add(pid)
                self.facts.observe(text)
                return self._part(launcher, text)
            return self._part(slots.pid(pid, self.facts.segment), text)
        if L.is_cfe_start(text):
            return self._open(B.BlockKind.CHILD_FAILED, launcher, text, bare=False)
        if L.CFE_FIELD.match(text):
            self.facts.observe(text)
            if L.CFE_TRACEBACK.match(text):   # the error file's traceback follows, indented
                part = self._open(B.BlockKind.CHILD_FAILED, launcher, text, bare=False)
                self.block.state["field_traceback"] = True
                return part
            return self._part(launcher, text)
        if L.is_launch_future_warning(text):
            return self._open(B.BlockKind.WARNING, launcher, text, bare=False)
        notice = L.MPI_NOTICE.match(text)
        if notice and notice.group(3) is None:   # wrapped: the signal is on the next line
            return self._open(B.BlockKind.MPI_NOTICE, launcher, text, bare=False)
        if L.is_shell_or_scheduler(text):
            self.facts.observe(text)
            return self._part(launcher, text)
        m = L.SPAWN_CHILD.match(text) or (L.HARNESS_CHILD.match(text) if "exited with error code" in text else None)
        if m:
            self.spawn_rank = int(m.group(1))
            return self._part(launcher, text)
        if PROBE.match(text):
            return self._part(slots.fixed(StreamKind.PROBE), text)
        if self.spawn_rank is not None and not B.TRACEBACK_START.match(text):
            # mp.spawn: what follows `-- Process N terminated with the following error:` is that
            # child's (a traceback, or just its exception when the paste elides the frames)
            return self._open_or_plain(self._rank_slot(self.spawn_rank, ""), text, bare=False)
        if B.BANNER_TITLE.match(text):
            return self._open(B.BlockKind.BANNER, slots.fixed(StreamKind.BANNER), text, bare=False)
        if B.BANNER_RULE.match(text):
            self.pending_rule = slots.new_block()
            return self._part(self.pending_rule, text)
        marker = find_rank_marker(text)
        if B.TRACEBACK_START.match(text):
            if self.unanswered_header:
                self.unanswered_header = 0
                part = self._open(B.BlockKind.IGNORED, slots.fixed(StreamKind.UNATTRIBUTED), text, bare=True)
                self.block.state["traceback"] = True
                return part
            return self._open(B.BlockKind.TRACEBACK, slots.new_block(), text, bare=True)
        slot = self._rank_slot(marker, "") if marker is not None else slots.fixed(StreamKind.UNATTRIBUTED)
        if marker is not None and text.endswith("Traceback (most recent call last):"):
            # a logger's record that opens the traceback (`rank:  3 | ... CRITICAL | Traceback ...`)
            return self._open(B.BlockKind.TRACEBACK, slot, text, bare=False)
        part = self._open_or_plain(slot, text, bare=False)
        if marker is not None and part.block_id >= 0 and ERROR_RECORD.search(text):
            self.error_record_slot = slot   # a plain line had it set in _open_or_plain already
        return part

    def _open_or_plain(self, slot: int, text: str, bare: bool) -> Part:
        kind = block_start(text)
        if kind is not None:
            return self._open(kind, slot, text, bare)
        frame = FRAME.match(text) if text.lstrip()[:6] == 'File "' else None
        if frame and len(frame.group(1)) <= 4:
            part = self._open(B.BlockKind.TRACEBACK, slot, text, bare)
            if not text[0].isspace():
                self.block.state["bare"] = "frame"   # its code line follows at column 0 too
            self._watch_block_line(self.block, text)
            return part
        if EXCEPTION_START.match(text):
            # An exception line without its traceback (a paste that starts mid-way): its
            # message's continuation lines still belong to it.
            part = self._open(B.BlockKind.TRACEBACK, slot, text, bare)
            self.block.state.update(message=True, exception=text, prefixed=not bare)
            return part
        if text.strip():
            self.error_record_slot = slot if ERROR_RECORD.search(text) else None
        return self._part(slot, text)
