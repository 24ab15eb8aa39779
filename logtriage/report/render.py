"""render(report, format): the one entry point for every rendering."""

from __future__ import annotations

import orjson

from logtriage.errors import UsageError
from logtriage.report.markdown import render_markdown
from logtriage.report.model import Report
from logtriage.report.text import render_text

FORMATS = ("text", "md", "json")


def render(report: Report, fmt: str = "text", color: bool = False) -> str:
    if fmt == "text":
        return render_text(report, color=color)
    if fmt == "md":
        return render_markdown(report)
    if fmt == "json":
        return orjson.dumps(report.to_dict(), option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode() + "\n"
    raise UsageError(f"unknown format '{fmt}' (choose from {', '.join(FORMATS)})")
