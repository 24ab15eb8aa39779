"""The terminal rendering: verdict and root cause first, then the chain, the ranks (identical
rows collapsed as "ranks 1–7"), the fix and the misdiagnosis to avoid."""

from __future__ import annotations

import re
import textwrap

from logtriage.report.model import RankRow, Report, RootCauseView
from logtriage.report.safe import terminal_safe, terminal_safe_document
from logtriage.rank_ranges import ranges

_MASK = re.compile(r"\d+")
MAX_RANK_ROWS = 40    # rows of the rank table before ranks of a kind share one row
WIDTH = 100


class Style:
    def __init__(self, color: bool):
        self.color = color

    def _wrap(self, code: str, text: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color else text

    def bold(self, t: str) -> str:
        return self._wrap("1", t)

    def red(self, t: str) -> str:
        return self._wrap("1;31", t)

    def yellow(self, t: str) -> str:
        return self._wrap("33", t)

    def green(self, t: str) -> str:
        return self._wrap("1;32", t)

    def dim(self, t: str) -> str:
        return self._wrap("2", t)


def render_text(report: Report, color: bool = False) -> str:
    s = Style(color)
    out: list[str] = []
    rc = report.root_cause
    verdict = report.verdict.upper()
    back = report.recovered
    if rc is None and back is not None:
        out.append(s.green(f"triage: {verdict}") + terminal_safe(
            f" — the run finished; it recovered (a restart, or the script went on: see the notes) from "
            f"{who_of(back.rank, back.ranks, back.stream, back.layer)}: {_what(back)}"))
        out += ["", s.bold("Recovered failure") + "  " + " · ".join(_facts(back))]
        out += _where_and_why(back, s)
    elif rc is None:
        out.append(s.green(f"triage: {verdict}") + " — no failure found in "
                   f"{report.input_lines} lines ({len(report.ranks)} ranks)")
    else:
        head = f"triage: {verdict} — {who_of(rc.rank, rc.ranks, rc.stream, rc.layer)}: {_what(rc)}"
        out.append((s.red if report.verdict == "failed" else s.yellow)(terminal_safe(head)))
        out.append("")
        out.append(s.bold("Root cause") + "  " + " · ".join(_facts(rc)))
        out += _where_and_why(rc, s)
    if report.chain:
        out += ["", s.bold("Causal chain")]
        for i, link in enumerate(report.chain, 1):
            who = _who(None, link.ranks) if link.ranks else "unattributed"
            times = f" ×{link.count}" if link.count > 1 else ""
            out.append(f"  {i}. {link.role:<10} {who:<14} {link.rule_id:<28} line {link.line}{times}")
            out.append(s.dim(f"     {terminal_safe(_short(link.text, WIDTH - 5))}"))
    if report.ranks:
        out += ["", s.bold("Ranks"), f"  {'rank':<12} {'status':<8} {'role':<9} {'lines':>7} {'last step':>9}  first error"]
        for label, row in _collapsed(report.ranks):
            first = f"line {row.first_error_line}: {_short(row.first_error or '', 60)}" if row.first_error_line else ""
            step = "" if row.last_step is None else str(row.last_step)
            out.append(f"  {label:<12} {row.status:<8} {row.role:<9} {row.lines:>7} {step:>9}  {terminal_safe(first)}")
    if report.environment:
        env = ", ".join(f"{k}={_short(str(v), 40)}" for k, v in list(report.environment.items())[:12])
        out += ["", s.bold("Environment"), *_wrapped(env, "  ")]
    if rc is not None:
        for title, text in (("What to do", rc.fix), ("Don't conclude", rc.misdiagnosis)):
            if text:
                out += ["", s.bold(title)] + _wrapped(text, "  ")
    if report.notes or report.problems:
        out += ["", s.bold("Notes")] + [ln for n in (*report.notes, *report.problems)
                                        for ln in _wrapped(n, "  - ")]
    out += ["", s.dim(f"{report.input_lines} lines read from {len(report.sources)} source(s); "
                      f"{report.unattributed_lines} not attributable to a rank or the launcher")]
    return terminal_safe_document("\n".join(out), keep_colour=color) + "\n"


def _what(rc: RootCauseView) -> str:
    return _short(rc.text, 90) if rc.rule_id == "python.exception" and rc.text else rc.title


def _facts(rc: RootCauseView) -> list[str]:
    facts = [f"rule {rc.rule_id}", f"category {rc.category}"]
    if rc.exception_type:
        facts.append(f"exception {rc.exception_type}")
    facts.append(f"confidence {rc.confidence:.2f}")
    return facts


def _where_and_why(rc: RootCauseView, s: Style) -> list[str]:
    out = []
    if rc.line is not None:
        out.append(f"  at {rc.source}:{rc.line}" + (f" ({rc.stream})" if rc.stream else ""))
    for reason in rc.reasons:
        out += _wrapped(reason, "  why: ")
    if rc.evidence:
        out.append("")
        for ev in rc.evidence:
            marker = ">" if ev.is_match else " "
            line = f"  {marker} {ev.line:>7} │ {terminal_safe(ev.text)}"
            out.append(s.bold(line) if ev.is_match else line)
    return out


def who_of(rank: int | None, ranks: tuple[int, ...], stream: str | None = "launcher", layer: str | None = None) -> str:
    """'rank 2', 'ranks 0–7', 'launcher' (a launcher-level failure) or 'rank unknown'."""
    if rank is None and not ranks:
        return "launcher" if stream in (None, "launcher") or layer == "launcher" else "rank unknown"
    return _who(rank, ranks)


def _who(rank: int | None, ranks: tuple[int, ...]) -> str:
    if len(ranks) > 1:
        return "ranks " + ranges(ranks)
    if rank is not None:
        return f"rank {rank}"
    if ranks:
        return f"rank {ranks[0]}"
    return "launcher"


def _collapsed(rows: tuple[RankRow, ...]):
    """Consecutive ranks with the same status, role and (number-masked) first error share a row.
    Where that still leaves more than MAX_RANK_ROWS rows (thousands of ranks whose kinds
    alternate), every rank of a kind shares one, labelled by its ranges and count."""
    groups: list[list[RankRow]] = []
    for row in rows:
        key = _key(row)
        if groups and groups[-1][0].rank == row.rank - len(groups[-1]) and _key(groups[-1][0]) == key:
            groups[-1].append(row)
        else:
            groups.append([row])
    if len(groups) > MAX_RANK_ROWS:
        yield from _by_kind(rows)
        return
    for group in groups:
        first = group[0]
        label = f"rank {first.rank}" if len(group) == 1 else f"ranks {first.rank}–{group[-1].rank}"
        if first.attempt:
            label += f" a{first.attempt}"
        yield label, first


def _by_kind(rows: tuple[RankRow, ...]):
    kinds: dict[tuple, list[RankRow]] = {}
    for row in rows:
        kinds.setdefault(_key(row), []).append(row)
    for group in sorted(kinds.values(), key=lambda g: (g[0].rank, g[0].attempt)):
        ranks = [row.rank for row in group]
        label = f"rank {ranks[0]}" if len(group) == 1 else f"ranks {ranges(ranks, limit=4)} ({len(group):,} ranks)"
        if group[0].attempt:
            label += f" a{group[0].attempt}"
        yield label, group[0]


def _key(row: RankRow):
    return (row.status, row.role, row.attempt, _MASK.sub("#", row.first_error or ""))


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _wrapped(text: str, prefix: str) -> list[str]:
    body = terminal_safe(" ".join(text.split()))
    return textwrap.wrap(body, WIDTH, initial_indent=prefix, subsequent_indent=" " * len(prefix)) or [prefix]
