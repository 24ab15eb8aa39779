"""Where no error of the catalog's points at a failure, or one does and the launcher's summary says more:
a forwarded hang-up, an exception no rule knows, a warning before a traceback, an exit code alone, the
summary's own error text, output that went to files, a traceback cut short, teardown only; then the
readings every failure gets last (a shared GPU, one rank's odd start, a stop while the ranks waited)."""

from __future__ import annotations

from logtriage.analysis.evidence import Evidence
from logtriage.analysis.exceptions import checkpoint_io
from logtriage.analysis.fallback_roots import (cut_traceback, exit_one_output_elsewhere, exit_only_root,
                                              unrecognised_exception)
from logtriage.analysis.gave_up import gave_up_before_exit
from logtriage.analysis.nccl_ranks import shared_gpu
from logtriage.analysis.odd_start import odd_start_rank
from logtriage.analysis.refine import stopped_while_waiting
from logtriage.analysis.rootcause import warning_root
from logtriage.analysis.roots import RootCause
from logtriage.analysis.rule_readings import writer_behind_readers
from logtriage.analysis.signal_readings import hangup_forwarded, teardown_only
from logtriage.analysis.summary_exceptions import error_file_exception, same_error_in_summary
from logtriage.catalog.rule import Role
from logtriage.scan_result import ScanResult

__all__ = ["read_fallbacks"]


def read_fallbacks(ev: Evidence, root: RootCause | None) -> RootCause | None:
    scan, keys, findings, failures, catalog = ev.scan, ev.keys, ev.findings, ev.failures, ev.catalog
    if root is None:
        root = hangup_forwarded(findings, catalog)
    if root is None:
        context_lines = {(f.source, f.line) for f in findings if f.rule.role is Role.CONTEXT}
        root = unrecognised_exception(scan, keys, catalog, context_lines)
    if root is None and (failures or "traceback" in scan.block_kinds.values()):
        root = warning_root(findings)
    if root is None and failures:
        root = exit_only_root(failures, catalog)
    if root is not None and failures:
        root = same_error_in_summary(checkpoint_io(error_file_exception(root, failures, catalog), catalog), failures,
                                     catalog)
    if root is not None:
        root = gave_up_before_exit(scan, keys, writer_behind_readers(root, findings), catalog)
        root = exit_one_output_elsewhere(root, scan, ev.stream_stats, failures, catalog)
    if root is None:
        root = cut_traceback(scan, keys, catalog)
    if root is None:
        root = teardown_only(findings)
    root = shared_gpu(root, findings, catalog)
    if root is not None:
        root = odd_start_rank(scan, keys, stopped_while_waiting(root, findings, _interrupted_frames(scan), catalog),
                              ev.facts)
    return root


def _interrupted_frames(scan: ScanResult) -> list[str]:
    """Innermost functions of tracebacks that were interrupted (KeyboardInterrupt) or cut short."""
    return [scan.block_last_frames[b] for b, kind in scan.block_kinds.items()
            if kind == "traceback" and b in scan.block_last_frames
            and "KeyboardInterrupt" in (scan.block_exceptions.get(b) or "KeyboardInterrupt")]
