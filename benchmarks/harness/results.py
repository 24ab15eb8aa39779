"""Benchmark results as values, and the issue-6 targets judged from them."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from statistics import median

from benchmarks.harness.machine import Machine
from benchmarks.harness.measure import Series, paired_ratios


class Outcome(str, Enum):
    MET = "met"
    MISSED = "missed"
    NOT_JUDGED = "not judged"


@dataclass(frozen=True)
class SizeResult:
    label: str
    size_bytes: int
    lines: int
    cat: Series
    grep: Series
    triage: Series
    check: str            # does the report name the injected failure? (one untimed run)

    @property
    def ratios(self) -> list[float]:
        return paired_ratios(self.triage, self.grep)

    @property
    def median_ratio(self) -> float:
        return median(self.ratios) if self.ratios else float("nan")

    @property
    def triage_mb_s(self) -> float:
        return self.size_bytes / 1e6 / self.triage.median_wall


@dataclass(frozen=True)
class RulesResult:
    label: str
    base_rules: int
    total_rules: int
    default: Series
    extra: Series

    @property
    def median_ratio(self) -> float:
        ratios = paired_ratios(self.extra, self.default)
        return median(ratios) if ratios else float("nan")


@dataclass(frozen=True)
class Target:
    text: str
    value: str
    outcome: Outcome


@dataclass(frozen=True)
class BenchResult:
    machine: Machine
    log_args: str
    pairs: int
    quick: bool
    sizes: tuple[SizeResult, ...]
    rules: RulesResult | None
    grep_patterns: int
    notes: tuple[str, ...]
    commands: tuple[str, ...]

    def scaling(self, pick: str) -> tuple[float, float] | None:
        """(time ratio largest/smallest, bytes ratio) for 'triage' or 'grep'."""
        if len(self.sizes) < 2:
            return None
        small, large = self.sizes[0], self.sizes[-1]
        t_small, t_large = getattr(small, pick).median_wall, getattr(large, pick).median_wall
        return t_large / t_small, large.size_bytes / small.size_bytes

    def linear_fit(self, pick: str) -> tuple[float, float, float] | None:
        """Least squares t = a + b * GB over the sizes' medians: (a seconds, b seconds per GB, the
        largest relative distance of a size's median from the line)."""
        if len(self.sizes) < 3:
            return None
        xs = [r.size_bytes / 1e9 for r in self.sizes]
        ys = [getattr(r, pick).median_wall for r in self.sizes]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        a = my - b * mx
        worst = max(abs(y - (a + b * x)) / y for x, y in zip(xs, ys))
        return a, b, worst

    def targets(self) -> list[Target]:
        largest = self.sizes[-1]
        judged = not self.quick and largest.size_bytes >= 900_000_000
        triage_ok = not largest.triage.failures

        def judge(ok: bool) -> Outcome:
            if not judged or not triage_ok:
                return Outcome.NOT_JUDGED
            return Outcome.MET if ok else Outcome.MISSED

        out = [
            Target(f"triage/grep ≤ 1.0 on {largest.label} (median of paired ratios)",
                   f"{largest.median_ratio:.2f}", judge(largest.median_ratio <= 1.0)),
            Target(f"triage peak RSS ≤ 300 MB on {largest.label}",
                   f"{largest.triage.peak_rss_kb / 1024:.0f} MB", judge(largest.triage.peak_rss_kb <= 300 * 1024)),
        ]
        scale = self.scaling("triage")
        if scale:
            t_ratio, b_ratio = scale
            rel = t_ratio / b_ratio
            out.append(Target(f"time grows linearly: {self.sizes[-1].label}/{self.sizes[0].label} within ±20% of "
                              f"{b_ratio:.1f}×", f"{t_ratio:.2f}× ({rel:.2f} of linear)", judge(0.8 <= rel <= 1.2)))
        fit = self.linear_fit("triage")
        if fit:
            a, b, worst = fit
            out.append(Target("time is linear in size after a fixed start-up: every size within ±20% of the "
                              "least-squares line t = a + b·size", f"a = {a:.2f} s, b = {b:.2f} s/GB, worst "
                              f"{worst * 100:.0f}%", judge(worst <= 0.2 and b > 0)))
        if self.rules:
            failed = self.rules.extra.failures or self.rules.default.failures
            # a run that exits with an error is fast and proves nothing: the target fails
            measured = (f"{self.rules.median_ratio:.2f}×" if not failed
                        else f"exit {failed[0].returncode}: {failed[0].stderr_tail or 'no message'}")
            out.append(Target(f"{self.rules.total_rules} rules ({self.rules.total_rules // max(1, self.rules.base_rules)}× "
                              f"the catalog) cost ≤ 1.5× the time on {self.rules.label}",
                              measured, Outcome.MISSED if failed else judge(self.rules.median_ratio <= 1.5)))
        return out
