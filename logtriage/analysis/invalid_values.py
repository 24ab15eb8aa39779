"""A distribution's argument check (`Expected parameter probs (Tensor of shape (3,)) of distribution
Categorical(...) to satisfy the constraint Simplex(), but found invalid values:`) prints the values it
refused on the lines below it. Where those are all finite numbers (a negative probability, a row that
does not sum to one, a scale below zero), the program's own arithmetic made them: a Python error in the
program, not a NaN or inf that reached the check."""

from __future__ import annotations

import re

from logtriage.analysis.exception_names import INSTALLED_PACKAGE, short_type
from logtriage.analysis.findings import Finding
from logtriage.analysis.roots import RootCause, read_as
from logtriage.analysis.stopped import message_of
from logtriage.catalog.loader import Catalog
from logtriage.ingest.lines import read_lines
from logtriage.scan_result import ScanResult

CHECK_RULE = "numerical.nonfinite_value"
SHOWN_LINES = 8          # the refused tensor's lines read below the error
_NONFINITE = re.compile(r"\b(?:nan|inf)\b", re.IGNORECASE)
LOSS_RULE = "numerical.loss_nan"
RAISED_WITHIN = 200      # lines from a printed non-finite loss to the exception the program raised over it
OWN_CHECK_RULE = "numerical.checked_nonfinite"


def finite_invalid_values(scan: ScanResult, root: RootCause, catalog: Catalog) -> RootCause:
    """numerical.nonfinite_value from a distribution's check whose refused values are all finite is
    python.exception: the values broke the constraint, not finiteness."""
    f = root.finding
    if root.rule.id != CHECK_RULE or f is None or "distribution" not in f.captures or f.source >= len(scan.sources):
        return root
    shown = _refused_values(scan, f.source, f.line)
    if not shown or _NONFINITE.search(shown) or not any(c.isdigit() for c in shown):
        return root
    return read_as(root, catalog, "python.exception", (
        f"the values the {f.captures['distribution']} check refused are all finite (`{shown[:80]}`): they break "
        f"its constraint ({f.captures.get('constraint', '?')}), which the program's own arithmetic did, not a NaN "
        "or inf"))


def own_loss_check(root: RootCause, findings: list[Finding], catalog: Catalog) -> RootCause:
    """numerical.loss_nan where the program raised a FloatingPointError over it (`raise
    FloatingPointError(f"loss is nan at step {step}")` on the root's line, or as the first exception of the
    same stream after it, its innermost frame in the job's own files) is numerical.checked_nonfinite, the program's own
    check, whichever value it checked, as the labels of the CPU runs name it. A framework's check (an
    innermost frame in site-packages: detectron2's `_detect_anomaly`) stays the loss's."""
    f = root.finding
    if root.rule.id != LOSS_RULE or f is None:
        return root
    # the first exception of the root's stream from its line on (a Lightning traceback between a printed loss
    # and the raise can run to a hundred lines)
    raised = next((g for g in findings if g.stream == f.stream and g.source == f.source
                   and f.line <= g.line <= f.line + RAISED_WITHIN and g.exception_type), None)
    if raised is None or short_type(raised.exception_type) != "FloatingPointError" \
            or INSTALLED_PACKAGE.search(raised.last_file):
        return root
    return read_as(root, catalog, OWN_CHECK_RULE, (
        "the program raised a FloatingPointError over it in its own code (not a framework's): its own "
        "finiteness check, here of the loss"))


def _refused_values(scan: ScanResult, source: int, line: int) -> str:
    """The tensor printed below the error (`tensor([ 0.4234,  0.6182, -0.0416])`), over as many lines as it takes."""
    numbers = list(range(line + 1, line + 1 + SHOWN_LINES))
    texts = read_lines(scan.sources[source], scan.indexes[source], numbers)
    shown: list[str] = []
    for number in numbers:
        text = message_of(texts.get(number, ""))
        if not shown and not text.startswith("tensor("):
            return ""
        shown.append(text)
        if text.rstrip().endswith(")"):
            return " ".join(shown)
    return ""
