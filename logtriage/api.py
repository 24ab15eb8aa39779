"""Library entry point: triage(inputs) -> Report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from logtriage.analysis.diagnose import Diagnosis, diagnose
from logtriage.catalog.loader import Catalog, load_catalog
from logtriage.catalog.matcher import Matcher
from logtriage.errors import UsageError
from logtriage.ingest.sources import discover
from logtriage.redact import Redactor, redact_report
from logtriage.report.build import build_report
from logtriage.report.model import Report
from logtriage.scan import scan
from logtriage.scan_result import ScanResult


@dataclass(frozen=True)
class TriageOptions:
    patterns_dirs: tuple[str, ...] = ()
    strict_catalog: bool = False          # a broken user rule stops the run instead of a warning
    redact: bool = True
    redact_extra: tuple[str, ...] = ()    # optional maskings: "hosts", "paths", "ips"
    progress: Callable[[int], None] | None = field(default=None, compare=False)
    engine: str = "auto"                  # auto | fast | exact: the fast scan for big inputs
    workers: int | None = None            # fast scan worker processes (None: one per core, at most 2)


@dataclass(frozen=True)
class TriageRun:
    """Everything one triage produced, for front ends that need more than the report (the TUI)."""
    report: Report
    scan: ScanResult
    diagnosis: Diagnosis
    catalog: Catalog


_CATALOG_CACHE: dict[tuple, Catalog] = {}
_MATCHER_CACHE: dict[tuple, tuple[Catalog, Matcher]] = {}


def get_catalog(patterns_dirs: Iterable[str] = ()) -> Catalog:
    key = tuple(patterns_dirs)
    if key not in _CATALOG_CACHE:
        _CATALOG_CACHE[key] = load_catalog(key)
    return _CATALOG_CACHE[key]


def get_matcher(catalog: Catalog, patterns_dirs: Iterable[str] = ()) -> Matcher:
    """The catalog's compiled pattern set, built once per catalog: compiling ~1,000 patterns into
    one RE2 set costs about 50 ms, more than scanning a small log, and a fresh set's DFA starts cold."""
    key = tuple(patterns_dirs)
    cached = _MATCHER_CACHE.get(key)
    if cached is None or cached[0] is not catalog:
        cached = _MATCHER_CACHE[key] = (catalog, Matcher(catalog))
    return cached[1]


def run_triage(inputs: Sequence[str], options: TriageOptions = TriageOptions()) -> TriageRun:
    catalog = get_catalog(options.patterns_dirs)
    if options.strict_catalog:
        catalog.strict()
    discovery = discover(inputs)
    matcher = get_matcher(catalog, options.patterns_dirs)
    if _use_fast(options.engine, discovery.sources):
        from logtriage.fastscan import fast_scan
        result = fast_scan(discovery.sources, matcher, options.progress, options.workers)
    else:
        result = scan(discovery.sources, matcher, options.progress)
    result.problems[:0] = [f"skipped {s}" for s in discovery.skipped]
    return finish(result, catalog, options)


def finish(result: ScanResult, catalog: Catalog, options: TriageOptions) -> TriageRun:
    """Diagnose a finished scan and build its (redacted) report: the steps after the scan, shared
    by one-shot runs and `--follow`."""
    result.problems[:0] = [f"rule problem: {p}" for p in catalog.problems]
    diag = diagnose(result, catalog)
    redactor, info = make_redactor(options)
    report = build_report(result, diag, redaction=info)
    if redactor is not None:
        report = redact_report(report, redactor)
    return TriageRun(report, result, diag, catalog)


def triage(inputs: Sequence[str], options: TriageOptions = TriageOptions()) -> Report:
    return run_triage(inputs, options).report


FAST_SCAN_BYTES = 16 << 20


def _use_fast(engine: str, sources) -> bool:
    if engine in ("fast", "exact"):
        return engine == "fast"
    if engine != "auto":
        raise UsageError(f"unknown engine '{engine}' (auto, fast, exact)")
    size = 0
    for source in sources:
        if source.path is not None:
            try:
                size += source.path.stat().st_size
            except OSError:
                pass
    return size >= FAST_SCAN_BYTES


def make_redactor(options: TriageOptions) -> tuple[Redactor | None, dict]:
    """Every log-derived string of the report is redacted (evidence, findings, environment facts,
    notes, source names), in every format."""
    if not options.redact:
        return None, {"enabled": False}
    return Redactor(extra=options.redact_extra), {"enabled": True, "extra": list(options.redact_extra)}
