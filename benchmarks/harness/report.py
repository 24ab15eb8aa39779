"""Render a BenchResult as Markdown and put it between the markers of docs/performance.md."""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness.results import BenchResult, Outcome, SizeResult
from logtriage.errors import InputError

START = "<!-- results:start -->"
END = "<!-- results:end -->"


def _s(seconds: float) -> str:
    return f"{seconds:.3f}" if seconds < 10 else f"{seconds:.1f}"


def _size_row(r: SizeResult) -> str:
    tri = r.triage
    status = "ok" if not tri.failures else f"exit {tri.failures[0].returncode} ×{len(tri.failures)}"
    ratio = f"**{r.median_ratio:.2f}**" if not (tri.failures or r.grep.failures) else f"({r.median_ratio:.2f}, invalid)"
    return (f"| {r.label} | {r.lines:,} | {_s(r.cat.median_wall)} | {_s(r.grep.median_wall)} "
            f"| {_s(tri.median_wall)} ({_s(tri.min_wall)}–{_s(tri.max_wall)}) | {_s(tri.median_cpu)} "
            f"| {ratio} | {r.triage_mb_s:.0f} | {tri.peak_rss_kb / 1024:.0f} | {status} | {r.check} |")


def render(result: BenchResult) -> str:
    m = result.machine
    out = [
        START,
        "",
        f"**{'Quick smoke run (sizes too small to judge the targets)' if result.quick else 'Full run'}**, "
        f"{m.date}, commit `{m.commit}`.",
        "",
        f"Machine: {m.cores} cores ({m.cpu_model}), {m.ram_gib:.0f} GiB RAM; Python {m.python}; {m.grep}; "
        f"locale {m.locale}; load average at start {m.load_avg}.",
        "",
        f"Logs: `benchmarks/generate.py {result.log_args}` at each size. {result.pairs} pairs per size, "
        f"order alternated; times are medians in seconds (triage: median, min–max); grep uses "
        f"{result.grep_patterns} patterns.",
        "",
        "| size | lines | cat | grep -cEf | triage | triage CPU | triage/grep | triage MB/s | triage peak RSS MB "
        "| triage exit | report vs sidecar |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
        *[_size_row(r) for r in result.sizes],
        "",
    ]
    for pick in ("triage", "grep"):
        scale = result.scaling(pick)
        if scale:
            t_ratio, b_ratio = scale
            out.append(f"- Scaling, {pick}: {result.sizes[-1].label} took {t_ratio:.2f}× the time of "
                       f"{result.sizes[0].label} for {b_ratio:.2f}× the bytes ({t_ratio / b_ratio:.2f} of linear).")
        fit = result.linear_fit(pick)
        if fit:
            out.append(f"  Least squares over the sizes: {pick} t = {fit[0]:.2f} s + {fit[1]:.2f} s/GB × size, "
                       f"every size within {fit[2] * 100:.0f}% of that line (a fixed start-up plus linear work).")
    if result.rules:
        rr = result.rules
        out.append(f"- Rules: with {rr.total_rules} rules ({rr.base_rules} built-in + "
                   f"{rr.total_rules - rr.base_rules} synthetic) triage took {_s(rr.extra.median_wall)} s against "
                   f"{_s(rr.default.median_wall)} s with the default catalog on {rr.label}: "
                   f"**{rr.median_ratio:.2f}×** (median of paired ratios).")
    out += ["", "| issue-6 target | measured | outcome |", "|---|---|---|"]
    for target in result.targets():
        mark = {Outcome.MET: "✅ met", Outcome.MISSED: "❌ missed", Outcome.NOT_JUDGED: "— not judged"}[target.outcome]
        out.append(f"| {target.text} | {target.value} | {mark} |")
    if result.notes:
        out += ["", "Notes:", *[f"- {note}" for note in result.notes]]
    out += ["", "Commands (LOG, PATTERNS and RULES_DIR live in the scratch directory):", "", "```",
            *result.commands, "```", "", END]
    return "\n".join(out)


def update_doc(doc: Path, section: str) -> None:
    """Replace the text between the markers (inclusive) with `section`."""
    try:
        text = doc.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{doc}: cannot read: {exc}") from exc
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise InputError(f"{doc}: markers {START} ... {END} not found")
    doc.write_text(text[:start] + section + text[end + len(END):], encoding="utf-8")
