"""Roots for a failed run no rule explains: an exception no rule knows, an exit code with no error
printed, a traceback cut before its exception line. Never an empty report for a failed run."""

from __future__ import annotations

from dataclasses import replace

from logtriage.analysis.childfailed import ChildFailure, is_own_failure
from logtriage.analysis.findings import Finding, mask_numbers
from logtriage.analysis.hangs import fallback_rule
from logtriage.analysis.roots import RootCause
from logtriage.analysis.signal_readings import exit_rule
from logtriage.analysis.stopped import message_of
from logtriage.catalog.loader import Catalog
from logtriage.catalog.rule import Category
from logtriage.demux.launcher import LAUNCH_BANNER, SENDING
from logtriage.demux.streams import StreamKey, StreamKind
from logtriage.ingest.lines import read_lines
from logtriage.scan_result import ScanResult, SlotStats, step_number


def exit_only_root(failures: list[ChildFailure], catalog: Catalog) -> RootCause | None:
    own = [f for f in failures if is_own_failure(f.exitcode)]
    if not own:
        return None
    first = next((f for f in own if f.is_root_cause), own[0])
    rule = exit_rule(catalog)
    return RootCause(rule, None, first.rank, (first.rank,) if first.rank is not None else (), 0.3,
                     (f"rank {first.rank} exited with code {first.exitcode}; its output holds no error",))


OUTPUT_ELSEWHERE = "python.exit_one_output_elsewhere"
# the streams a console whose workers wrote to files still has
_AGENT_KINDS = (StreamKind.LAUNCHER, StreamKind.BANNER, StreamKind.PROBE)


def exit_one_output_elsewhere(root: RootCause, scan: ScanResult, stream_stats: dict[StreamKey, SlotStats],
                              failures: list[ChildFailure], catalog: Catalog) -> RootCause:
    """An exit code 1 with no message, in a console that holds torchrun's whole run (its start-up
    banner, or its teardown as the file's first line; then the summary) and not one line of that
    worker: none of any worker (`--redirects`), or only other ranks' labelled lines (`--tee 3
    --local-ranks-filter 0`). Its output went to files, and 1 is the interpreter's exit on an
    uncaught exception. A paste of the summary alone (no banner, and a first line that is not the
    teardown), or a line no rank's label claims (it may be that worker's), stays an exit code."""
    if root.rule.id != exit_rule(catalog).id or root.rank is None:
        return root
    codes = {f.exitcode for f in failures if f.rank == root.rank}
    if codes != {1} or not (_whole_console(scan.launcher_lines) or _from_the_first_step(scan, stream_stats)
                            or _others_opened_alike(scan, stream_stats, root.rank)):
        return root
    if any(stats.lines for key, stats in stream_stats.items() if key.kind not in _AGENT_KINDS
           and (key.kind is not StreamKind.RANK or key.rank == root.rank)):
        return root   # a line no rank's label claims, or one of the failed rank's own
    rule = catalog.get(OUTPUT_ELSEWHERE) or fallback_rule(OUTPUT_ELSEWHERE, Category.PYTHON_EXCEPTION,
                                                          "A worker exited with code 1 and its output went elsewhere")
    return replace(root, rule=rule, confidence=min(root.confidence, 0.35), reasons=root.reasons + (
        f"torchrun's console holds its start-up and the failure summary but no line of rank {root.rank} (its "
        "output went to files, `--redirects`, or was filtered out); exit code 1 is Python's exit on an uncaught "
        f"exception, whose traceback is in rank {root.rank}'s own stderr file",))


def _whole_console(launcher_lines: list[tuple[int, int, str]]) -> bool:
    """torchrun's console from its start: its start-up banner, or, where OMP_NUM_THREADS was set and torchrun
    prints none, a file whose first line is the agent's teardown of its workers (`Sending process N closing
    signal SIGTERM`): no worker line ever came before it (cpu_adhoc 544th batch's redirects and filter runs)."""
    if any(LAUNCH_BANNER.search(text) for _, _, text in launcher_lines[:50]):
        return True
    return bool(launcher_lines) and launcher_lines[0][1] == 1 and SENDING.search(launcher_lines[0][2]) is not None


def _from_the_first_step(scan: ScanResult, stream_stats: dict[StreamKey, SlotStats]) -> bool:
    """A banner-less console (OMP_NUM_THREADS set) that begins with a rank's own line and holds that rank's
    progress from step 0: the run from its start (a `--local-ranks-filter 0,1` console whose first line is
    `rank 0/8 loaded rings_shard_00.pt`, cpu_adhoc 552nd batch), not a paste cut from its middle."""
    for key, stats in stream_stats.items():
        if key.kind is not StreamKind.RANK or stats.first_line is None or stats.first_line[1] != 1 \
                or stats.first_step_line is None:
            continue
        source, number = stats.first_step_line
        text = read_lines(scan.sources[source], scan.indexes[source], [number]).get(number, "")
        return step_number(message_of(text)) == 0
    return False


def _others_opened_alike(scan: ScanResult, stream_stats: dict[StreamKey, SlotStats], rank: int) -> bool:
    """Two or more other ranks' labelled output opens with the same line but for its numbers (`[default0]:rank
    0/6 gannet dive trainer up`, `[default1]:rank 1/6 ...`), a start-up line every rank prints once, and the
    failed rank has none of it: its output was filtered out (`--local-ranks-filter 0,1`), not cut from a paste
    that would have lost the others' opening lines too (cpu_adhoc 572nd batch). Progress lines do not count: a
    paste may begin at any step."""
    firsts: dict[int, list[int]] = {}     # source -> the ranks' first line numbers in it
    for key, stats in stream_stats.items():
        if key.kind is not StreamKind.RANK or stats.first_line is None:
            continue
        if key.rank == rank:
            return False
        firsts.setdefault(stats.first_line[0], []).append(stats.first_line[1])
    opened: set[str] = set()
    for source, numbers in firsts.items():   # one read back per source
        for text in read_lines(scan.sources[source], scan.indexes[source], numbers).values():
            message = message_of(text)
            if step_number(message) is not None:
                return False    # progress: a paste may begin at any step, after the failed rank's traceback
            opened.add(mask_numbers(message).strip())
    return sum(map(len, firsts.values())) >= 2 and len(opened) == 1 and "" not in opened


def unrecognised_exception(scan: ScanResult, keys: list[StreamKey], catalog: Catalog,
                            context_lines: set[tuple[int, int]]) -> RootCause | None:
    """A traceback whose exception no rule knows (a type without an Error/Exception suffix): the
    last such exception of a worker is the report, never an empty one for a failed run. An
    exception a context rule reads (a thread's error as the interpreter shuts down) is not one."""
    for block_id in sorted(scan.block_exception_lines, reverse=True):
        slot = scan.block_slots.get(block_id)
        exception = scan.block_exceptions.get(block_id, "")
        if slot is None or not exception or block_id in scan.block_exit_hooks:
            continue   # (a finalizer's exception at exit: printed, and the exit went on)
        stream = keys[scan.slots.final(slot)]
        if stream.kind is StreamKind.LAUNCHER:
            continue
        source, line = scan.block_exception_lines[block_id]
        if (source, line) in context_lines:
            continue
        name = exception.split(":", 1)[0].strip()
        rule = catalog.get("python.exception") or fallback_rule("python.exception", Category.PYTHON_EXCEPTION,
                                                                "Unhandled Python exception")
        finding = Finding(rule, {"exception_type": name}, source, line, stream, stream.rank_or_none, exception,
                          block_id, scan.seq + 1, None, "stream", exception)
        return RootCause(rule, finding, finding.rank, (finding.rank,) if finding.rank is not None else (), 0.5,
                         (f"no rule knows this exception; {name} ended the traceback",))
    return None


def cut_traceback(scan: ScanResult, keys: list[StreamKey], catalog: Catalog) -> RootCause | None:
    """A worker's traceback that stops before its exception line: the run failed, with an error
    the log does not hold (never an OK report for a log with a traceback in it)."""
    for block_id in sorted(scan.blocks, reverse=True):
        slot = scan.block_slots.get(block_id)
        if scan.block_kinds.get(block_id) != "traceback" or scan.block_exceptions.get(block_id) or slot is None:
            continue
        stream = keys[scan.slots.final(slot)]
        source, first, last = scan.blocks[block_id]
        if stream.kind is StreamKind.LAUNCHER or last - first < 2:
            continue
        checkpoint = scan.block_checkpoint_frames.get(block_id, "")
        rule_id = "ckpt.io_error" if checkpoint else "python.traceback_cut"   # cut inside torch.load, a save
        rule = catalog.get(rule_id) or fallback_rule(
            "python.traceback_cut", Category.UNKNOWN, "A traceback without its exception line")
        # the block's first line: `Traceback (most recent call last):`, or a frame when the paste cut that
        head = read_lines(scan.sources[source], scan.indexes[source], [first]).get(first, "")
        text = message_of(head) or "Traceback (most recent call last):"
        finding = Finding(rule, {}, source, first, stream, stream.rank_or_none, text,
                          block_id, scan.seq + 1, None, last_frame=scan.block_last_frames.get(block_id, ""))
        rank = finding.rank
        inside = f", inside `{checkpoint}`: saving or loading a checkpoint failed" if checkpoint else ""
        return RootCause(rule, finding, rank, (rank,) if rank is not None else (), 0.3, (
            f"the traceback at line {first} stops at line {last} before its exception line{inside}; "
            "the error itself was cut from this log",))
    return None
