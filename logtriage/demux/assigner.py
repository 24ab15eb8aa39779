"""Assign every physical line to exactly one slot (see streams.py), one line at a time.

Order of evidence for a line: an explicit prefix (srun, MPI, tee, template, excepthook, C++)
> the open multi-line block it continues > the launcher's own line shapes > a probe line >
a container banner > a rank marker in the text (`[Rank 3]`, `rank=3`) > a worker pid named in
a py-glog header > unattributed. Empty lines follow the block or line they sit in."""

from __future__ import annotations

import re
from logtriage.demux import blocks as B
from logtriage.demux.blocks import Block, Part, resumable
from logtriage.demux import launcher as L
from logtriage.demux.clean import after_bar, ungrouped
from logtriage.demux.frames import TracebackFacts, watch_traceback_line
from logtriage.demux.line_marks import find_rank_marker, pieces_of
from logtriage.demux.prefixes import Dialect, strip_prefixes
from logtriage.demux.streams import SlotTable, StreamKind
from logtriage.demux.unprefixed import UnprefixedLines

_LAUNCHER_EXCEPTIONS = re.compile(r"(?:ChildFailedError|SignalException|RendezvousConnectionError|"
                                  r"RendezvousTimeoutError|RendezvousClosedError|ProcessRaisedException|"
                                  r"ProcessExitedException)\b")

# how many lines of other processes may stand between an ignored exception's header and its traceback
UNANSWERED_HEADER_REACH = 8


class Assigner(UnprefixedLines):
    """Stateful per input run; call feed() for each cleaned line, then close()."""

    def __init__(self, slots: SlotTable, facts: L.LauncherFacts, dialect: Dialect,
                 rank_hint: int | None = None, attempt_hint: int | None = None):
        self.slots, self.facts, self.dialect = slots, facts, dialect
        self.rank_hint, self.attempt_hint = rank_hint, attempt_hint
        self.block: Block | None = None
        # blocks of prefixed streams another stream's line interrupted, by slot: the owner's next
        # line may continue them (`[trainer3]:terminate called ...`, other ranks' lines, then
        # `[trainer3]:  what():  ...`)
        self.suspended: dict[int, Block] = {}
        self.last_slot = slots.fixed(StreamKind.UNATTRIBUTED)
        self.error_record_slot: int | None = None
        self.spawn_rank: int | None = None
        self.pending_rule: int | None = None
        # lines left in which a bare traceback answers a header of an ignored exception (`--- Logging
        # error ---`) that other processes' lines cut off from it
        self.unanswered_header = 0
        self.blocks: dict[int, tuple[B.BlockKind, int]] = {}   # block id -> (kind, slot)
        self.tracebacks = TracebackFacts()
        facts.new_console()     # a source file is a console of its own

    # -- public -------------------------------------------------------------------------------
    def feed(self, line: str) -> list[Part]:
        pieces = pieces_of(line, self.dialect)
        parts = [self._assign(pieces[0])]
        for piece in pieces[1:]:
            parts.append(self._assign(piece))
        return parts

    def close(self) -> None:
        self._close_block()
        for slot in list(self.suspended):
            self._close_suspended(slot)
        self._settle_pending_rule(None)

    # -- one piece ----------------------------------------------------------------------------
    def _assign(self, line: str) -> Part:
        p = strip_prefixes(line, self.dialect)
        text = p.text
        if "/s]" in text or "/it]" in text:     # a progress bar with a message glued after it
            text = after_bar(text)
        if text[:1] in " +|" and ("| " in text or "+-" in text or "+ E" in text):   # an exception group's margin
            text = ungrouped(text)
        if "ray" in p.layers:
            self.facts.ray_workers = True
        self._settle_pending_rule(text)
        if self.unanswered_header:
            self.unanswered_header -= 1
        if p.host:
            self._note_host_rank(p)
        rank = p.rank if p.rank is not None else p.local_rank
        if rank is not None and text.startswith("slurmstepd"):
            rank = None   # the node's step daemon, on whichever task's stream srun --label put it
        if rank is None and self.rank_hint is not None:
            rank = self.rank_hint
        explicit_slot = None
        if self.dialect.local_scoped and p.local_rank is not None and not p.host and self.attempt_hint is None:
            console = self.facts.local_line(p.local_rank, p.rank)
            if p.rank is None:   # a local rank alone: its console's global rank, once known
                explicit_slot = self.slots.local(p.local_rank, console, self.facts.segment)
        if explicit_slot is None and rank is not None:
            explicit_slot = self._rank_slot(rank, p.host or "")

        block = self.block
        if block is not None:
            same_owner = explicit_slot is None or explicit_slot == block.slot
            summary_line = block.kind is not B.BlockKind.CHILD_FAILED and L.CFE_FIELD.match(text)
            block.state["line_prefixed"] = explicit_slot is not None
            if same_owner and not summary_line and B.continues(block.kind, text, block.state):
                self._watch_block_line(block, text)
                part = self._part(block.slot, text, block.block_id)
                child = L.HARNESS_CHILD.match(text) if block.kind is B.BlockKind.TRACEBACK else None
                if child:   # what follows is that process's own exception
                    self._close_block()
                    self.spawn_rank = int(child.group(1))
                return part
            if resumable(block) and explicit_slot != block.slot:
                self.suspended[block.slot] = block
                self.block = None
            else:
                self._close_block()
            if self.block is not None:  # a traceback that turned into a ChildFailedError block
                if B.continues(self.block.kind, text, self.block.state):
                    return self._part(self.block.slot, text, self.block.block_id)
                self._close_block()

        if explicit_slot is not None:
            resumed = self.suspended.get(explicit_slot)
            if resumed is not None:
                if not L.CFE_FIELD.match(text) and B.continues(resumed.kind, text, resumed.state):
                    self.block = self.suspended.pop(explicit_slot)
                    self._watch_block_line(resumed, text)
                    return self._part(resumed.slot, text, resumed.block_id)
                self._close_suspended(explicit_slot)
            part = self._open_or_plain(explicit_slot, text, bare=False)
            if self.block is not None and part.block_id == self.block.block_id:
                self.block.state["explicit"] = True
            return part
        return self._unprefixed(text)

    def _close_suspended(self, slot: int) -> None:
        current, self.block = self.block, self.suspended.pop(slot)
        self._close_block()
        if self.block is not None:   # it became a ChildFailedError block: nothing follows it now
            self._close_block()
        self.block = current

    # -- blocks -------------------------------------------------------------------------------
    def _open(self, kind: B.BlockKind, slot: int, text: str, bare: bool) -> Part:
        block = Block(kind, slot, self.slots.next_block_id(), bare)
        if kind is B.BlockKind.TRACEBACK:
            block.state["owner_hint"] = self.error_record_slot
            block.state["prefixed"] = not bare
        self.block = block
        self.blocks[block.block_id] = (kind, slot)
        return self._part(slot, text, block.block_id)

    def _watch_block_line(self, block: Block, text: str) -> None:
        if block.kind is B.BlockKind.TRACEBACK:
            watch_traceback_line(block.state, text, block.bare)
        elif block.kind is B.BlockKind.CHILD_FAILED:
            self.facts.observe(text)

    def _close_block(self) -> None:
        block, self.block = self.block, None
        if block is not None and block.kind is B.BlockKind.IGNORED and not block.state.get("traceback"):
            self.unanswered_header = UNANSWERED_HEADER_REACH
        if block is None or block.kind is not B.BlockKind.TRACEBACK:
            return
        exception = block.state.get("exception", "")
        self.tracebacks.record(block.block_id, block.state)
        becomes_cfe = L.is_cfe_start(exception)
        if block.bare:
            self.slots.redirect[block.slot] = self._bare_owner(block, exception, becomes_cfe)
        self.error_record_slot = None
        if becomes_cfe:
            launcher = self.slots.fixed(StreamKind.LAUNCHER)
            self.block = Block(B.BlockKind.CHILD_FAILED, launcher, self.slots.next_block_id(), False)
            self.blocks[self.block.block_id] = (B.BlockKind.CHILD_FAILED, launcher)

    def _bare_owner(self, block: Block, exception: str, becomes_cfe: bool) -> int:
        slots = self.slots
        if block.state.get("launcher") or becomes_cfe or _LAUNCHER_EXCEPTIONS.search(exception):
            return slots.fixed(StreamKind.LAUNCHER)
        if self.spawn_rank is not None:
            rank, self.spawn_rank = self.spawn_rank, None
            return self._rank_slot(rank, "")
        if block.state.get("owner_hint") is not None:
            return block.state["owner_hint"]
        marker = find_rank_marker(exception.split(":", 1)[-1]) if exception else None
        if marker is not None:
            return self._rank_slot(marker, "")
        return slots.fixed(StreamKind.UNATTRIBUTED)

    def _settle_pending_rule(self, text: str | None) -> None:
        """A bare `=====` line is a banner's top rule if the next line is `== Title ==`."""
        if self.pending_rule is None:
            return
        pending, self.pending_rule = self.pending_rule, None
        banner = text is not None and B.BANNER_TITLE.match(text)
        self.slots.redirect[pending] = self.slots.fixed(
            StreamKind.BANNER if banner else StreamKind.UNATTRIBUTED)

    # -- for the fast path --------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """No open block and no pending decision: the next plain line's slot depends on it alone."""
        return self.block is None and self.pending_rule is None and self.spawn_rank is None

    def note_line_number(self, number: int) -> None:
        """Tell the open traceback which input line just reached its exception line."""
        block = self.block
        if block is not None and block.kind is B.BlockKind.TRACEBACK and "exception" in block.state \
                and "exception_line" not in block.state:
            block.state["exception_line"] = number
        if block is not None and block.kind is B.BlockKind.TRACEBACK and block.state.get("handling", 0) is None:
            block.state["handling"] = number

    def slot_for_rank(self, rank: int | None) -> int:
        """The slot a plain line of this rank (None: no rank) gets."""
        if rank is None:
            return self.slots.fixed(StreamKind.UNATTRIBUTED)
        return self._rank_slot(rank, "")

    def after_plain_lines(self, last_slot: int) -> None:
        """The state a run of plain lines leaves: they set last_slot and clear error records."""
        self.last_slot = last_slot
        self.error_record_slot = None

    # -- helpers ------------------------------------------------------------------------------
    def _note_host_rank(self, p) -> None:
        """Which global rank a host's local rank is (pdsh + --tee prints only the local one)."""
        if p.local_rank is not None:
            rank = p.rank if p.rank is not None else find_rank_marker(p.text)
            if rank is not None:
                self.facts.host_rank.setdefault((p.host, p.local_rank), rank)
            return
        m = L.CFE_RANK.match(p.text)
        if m:
            self.facts.host_rank.setdefault((p.host, int(m.group(2))), int(m.group(1)))

    def _rank_slot(self, rank: int, host: str) -> int:
        if self.attempt_hint is not None:
            return self.slots.rank_attempt(rank, host, self.attempt_hint)
        return self.slots.rank(rank, host, self.facts.segment)

    def _part(self, slot: int, text: str, block_id: int = -1) -> Part:
        if text.strip():
            self.last_slot = slot
        return Part(slot, text, block_id)
