"""The Markdown rendering, to paste into an incident record or a tracker issue."""

from __future__ import annotations

from logtriage.report.model import Report, RootCauseView
from logtriage.report.safe import markdown_code_block, markdown_code_span as code, markdown_inline as md
from logtriage.rank_ranges import ranges
from logtriage.report.text import who_of


def render_markdown(report: Report) -> str:
    rc = report.root_cause
    out: list[str] = []
    back = report.recovered
    if rc is None and back is not None:
        who = who_of(back.rank, back.ranks, back.stream, back.layer)
        out += [f"## triage: {report.verdict} — recovered", "",
                f"The run finished. The failure it recovered from (torchrun restarted the workers, or the script "
                f"caught it and went on: see the notes): {md(who)}: {md(back.title)}.", ""]
        out += _root_table(back, who)
    elif rc is None:
        out += [f"## triage: {report.verdict}", "", f"No failure found in {report.input_lines} lines."]
    else:
        who = who_of(rc.rank, rc.ranks, rc.stream, rc.layer)
        out += [f"## triage: {report.verdict} — {md(who)}: {md(rc.title)}", ""]
        out += _root_table(rc, who)
    if report.chain:
        out += ["", "### Causal chain", "", "| # | role | ranks | rule | line | text |", "|---|---|---|---|---|---|"]
        for i, c in enumerate(report.chain, 1):
            ranks = ranges(c.ranks) if c.ranks else "—"
            out.append(f"| {i} | {c.role} | {md(ranks)} | {code(c.rule_id)} | {c.line} | {md(c.text[:160])} |")
    if report.ranks:
        out += ["", "### Ranks", "", "| rank | status | role | lines | last step | first error |",
                "|---|---|---|---|---|---|"]
        for r in report.ranks:
            first = f"line {r.first_error_line}: {r.first_error[:100]}" if r.first_error_line and r.first_error else ""
            step = "" if r.last_step is None else r.last_step
            rank = f"{r.rank}" + (f" (attempt {r.attempt})" if r.attempt else "")
            out.append(f"| {rank} | {r.status} | {r.role} | {r.lines} | {step} | {md(first)} |")
    if rc is not None:
        for title, text in (("What to do", rc.fix), ("Misdiagnosis to avoid", rc.misdiagnosis), ("Why", rc.explanation)):
            if text:
                out += ["", f"### {title}", "", md(" ".join(text.split()))]
    if report.environment:
        out += ["", "### Environment", "", "| fact | value |", "|---|---|"]
        out += [f"| {md(str(k))} | {md(str(v)[:200])} |" for k, v in report.environment.items()]
    if report.notes or report.problems:
        out += ["", "### Notes", ""] + [f"- {md(n)}" for n in (*report.notes, *report.problems)]
    out += ["", f"_{report.input_lines} lines from {len(report.sources)} source(s); "
                f"{report.unattributed_lines} unattributed._"]
    return "\n".join(out) + "\n"


def _root_table(rc: RootCauseView, who: str) -> list[str]:
    out = ["| | |", "|---|---|", f"| rule | {code(rc.rule_id)} |", f"| category | {md(rc.category)} |",
           f"| rank(s) | {md(who)} |"]
    if rc.exception_type:
        out.append(f"| exception | {md(rc.exception_type)} |")
    if rc.line is not None:
        out.append(f"| where | {md(str(rc.source))}:{rc.line} |")
    out.append(f"| confidence | {rc.confidence:.2f} |")
    if rc.reasons:
        out += [""] + [f"- {md(r)}" for r in rc.reasons]
    if rc.evidence:
        out += ["", "### Evidence", "",
                markdown_code_block([f"{'>' if e.is_match else ' '} {e.line:>7} | {e.text}" for e in rc.evidence])]
    return out
