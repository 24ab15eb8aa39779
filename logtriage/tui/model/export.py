"""Export the report as Markdown (`w` in the viewer), under the names the user gave the inputs:
a log read from standard input is `<stdin>`, not the temporary file it was spooled to."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from logtriage.errors import InputError
from logtriage.report import render
from logtriage.report.model import Report


def renamed(report: Report, names: dict[str, str]) -> Report:
    """The report with every source name in `names` replaced."""
    if not names:
        return report

    def name(value: str | None) -> str | None:
        return names.get(value, value) if value is not None else None

    rc = report.root_cause
    if rc is not None:
        rc = replace(rc, source=name(rc.source), evidence=tuple(replace(e, source=name(e.source)) for e in rc.evidence))
    return replace(
        report, root_cause=rc,
        chain=tuple(replace(c, source=name(c.source)) for c in report.chain),
        ranks=tuple(replace(r, first_error_source=name(r.first_error_source)) for r in report.ranks),
        findings=tuple(replace(f, source=name(f.source)) for f in report.findings),
        sources=tuple(name(s) for s in report.sources),
        notes=tuple(_substitute(n, names) for n in report.notes),
        problems=tuple(_substitute(p, names) for p in report.problems))


def _substitute(text: str, names: dict[str, str]) -> str:
    for old, new in names.items():
        text = text.replace(old, new)
    return text


def export_markdown(report: Report, path: str, names: dict[str, str]) -> Path:
    """Write the Markdown report; raises InputError when the file cannot be written."""
    target = Path(path).expanduser()
    try:
        target.write_text(render(renamed(report, names), "md"), encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{path}: cannot write ({exc.strerror or exc})") from None
    return target
