"""Measure `triage` against `grep -cEf` and `cat` on generated logs; write docs/performance.md.

    python benchmarks/run.py                      # 100M, 300M, 1G; 5 pairs each; 10x rules on 1G
    python benchmarks/run.py --quick              # 2M, 6M, 20M: a smoke run of the harness
    python benchmarks/run.py --sizes 100M,1G --pairs 7 --no-write

For each size: one warm-up `cat`, then N pairs. Each pair runs `cat LOG > /dev/null`, then
`triage --format json LOG > FILE` and `grep -cEf PATTERNS LOG > FILE` back to back (a file, not
/dev/null: GNU grep stops at its first match when it writes to /dev/null), the order
swapped every other pair; the ratio triage/grep is taken per pair and its median reported.
Logs are generated once per argument set into the scratch directory (default .bench/, git-ignored)
and reused while the generator's code is unchanged.
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import shutil
import sys
import tomllib
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.generate import generate_file  # noqa: E402
from benchmarks.harness.catalog_inputs import catalog_rule_count, grep_patterns, write_synthetic_rules  # noqa: E402
from benchmarks.harness.machine import describe_machine  # noqa: E402
from benchmarks.harness.measure import Series, alternate, run_timed  # noqa: E402
from benchmarks.harness.report import render, update_doc  # noqa: E402
from benchmarks.harness.results import BenchResult, RulesResult, SizeResult  # noqa: E402
from benchmarks.harness.verify import check_report  # noqa: E402
from benchmarks.loggen.expect import sidecar_path  # noqa: E402
from benchmarks.loggen.spec import FailureKind, GenSpec, Style, format_size, parse_size  # noqa: E402
from logtriage.errors import TriageError, UsageError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FULL_SIZES = "100M,300M,1G"
QUICK_SIZES = "2M,6M,20M"


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def generator_hash() -> str:
    digest = hashlib.sha1()
    for path in sorted((REPO / "benchmarks" / "loggen").glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


def ensure_log(spec: GenSpec, scratch: Path) -> tuple[Path, dict]:
    """The generated log for `spec`, made once per generator version; returns it and its sidecar."""
    stem = (f"gen-r{spec.ranks}-{format_size(spec.size)}-s{spec.seed}-{spec.failure.value}-{spec.style.value}"
            f"-at{spec.fail_at:g}")
    version = generator_hash()
    log = scratch / f"{stem}-{version}.log"
    if not (log.exists() and sidecar_path(log).exists()):
        for stale in scratch.glob("gen-*"):  # logs of an older generator, and half-written ones
            if f"-{version}." not in stale.name or stale.name.endswith(".partial"):
                stale.unlink()
        _say(f"generating {log.name} ...")
        generate_file(spec, log)
    return log, tomllib.loads(sidecar_path(log).read_text(encoding="utf-8"))


def count_lines(path: Path) -> int:
    count = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(16 << 20):
            count += chunk.count(b"\n")
    return count


def triage_command(option: str | None) -> list[str]:
    if option:
        return shlex.split(option)
    found = shutil.which("triage")
    return [found] if found else [sys.executable, "-m", "logtriage"]


def measure_size(label: str, log: Path, expect: dict, args: argparse.Namespace, triage: list[str],
                 patterns: Path, scratch: Path) -> SizeResult:
    commands = {
        "triage": ([*triage, "--format", "json", str(log)], (0,)),
        "grep": (["grep", "-cEf", str(patterns), str(log)], (0, 1)),
    }
    run_timed(["cat", str(log)])  # warm the page cache
    runs: dict[str, list] = {"cat": [], "triage": [], "grep": []}
    for i in range(args.pairs):
        runs["cat"].append(run_timed(["cat", str(log)]))
        for name in alternate(i, "triage", "grep"):
            argv, ok = commands[name]
            # stdout to a file, never /dev/null: GNU grep notices /dev/null and stops at the first
            # match (0.03 s for 1 GB), so both commands write their full output somewhere real
            runs[name].append(run_timed(argv, cwd=REPO, ok_codes=ok, keep_stdout=True))
        _say(f"  {label} pair {i + 1}/{args.pairs}: triage {runs['triage'][-1].wall_s:.3f} s, "
             f"grep {runs['grep'][-1].wall_s:.3f} s, cat {runs['cat'][-1].wall_s:.3f} s")
    check = "not checked"
    if not args.no_verify:
        report_path = scratch / f"{log.stem}.report.json"
        timing = run_timed(commands["triage"][0], cwd=REPO, stdout_path=report_path)
        check = (check_report(report_path, expect) if timing.ok
                 else f"✗ exit {timing.returncode}: {timing.stderr_tail or 'no message'}")
    size_bytes = log.stat().st_size
    lines = count_lines(log)
    return SizeResult(label, size_bytes, lines, Series(tuple(runs["cat"])), Series(tuple(runs["grep"])),
                      Series(tuple(runs["triage"])), check)


def measure_rules(label: str, log: Path, args: argparse.Namespace, triage: list[str], scratch: Path) -> RulesResult:
    base = catalog_rule_count(triage, REPO)
    extra = max(1, base * (args.rules_factor - 1))
    rules_dir = scratch / "synthetic-rules"
    write_synthetic_rules(rules_dir, extra)
    commands = {
        "default": [*triage, "--format", "json", str(log)],
        "extra": [*triage, "--format", "json", "--patterns", str(rules_dir), str(log)],
    }
    runs: dict[str, list] = {"default": [], "extra": []}
    for i in range(args.pairs):
        for name in alternate(i, "default", "extra"):
            runs[name].append(run_timed(commands[name], cwd=REPO, keep_stdout=True))
        _say(f"  rules pair {i + 1}/{args.pairs}: default {runs['default'][-1].wall_s:.3f} s, "
             f"{base + extra} rules {runs['extra'][-1].wall_s:.3f} s")
    return RulesResult(label, base, base + extra, Series(tuple(runs["default"])), Series(tuple(runs["extra"])))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=None, help=f"comma-separated sizes (default {FULL_SIZES})")
    parser.add_argument("--quick", action="store_true", help=f"small sizes ({QUICK_SIZES}) for a smoke run")
    parser.add_argument("--pairs", type=int, default=5, help="pairs per size (default 5; at least 5 for the targets)")
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--failure", choices=[k.value for k in FailureKind], default="oom")
    parser.add_argument("--style", choices=[s.value for s in Style], default="plain")
    parser.add_argument("--fail-at", type=float, default=0.97)
    parser.add_argument("--scratch", type=Path, default=REPO / ".bench", help="where logs go (default .bench/)")
    parser.add_argument("--triage", default=None, help="the triage command (default: `triage`, else python -m logtriage)")
    parser.add_argument("--rules-factor", type=int, default=10, help="catalog size multiple for the rules case")
    parser.add_argument("--no-rules", action="store_true", help="skip the larger-catalog measurement")
    parser.add_argument("--no-verify", action="store_true", help="skip comparing one report with the sidecar")
    parser.add_argument("--no-write", action="store_true", help="print the table; leave docs/performance.md alone")
    parser.add_argument("--doc", type=Path, default=REPO / "docs" / "performance.md")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except TriageError as exc:
        print(f"run: error: {exc}", file=sys.stderr)
        return exc.exit_code


def _run(args: argparse.Namespace) -> int:
    if args.pairs < 1 or args.rules_factor < 2:
        raise UsageError("--pairs must be at least 1 and --rules-factor at least 2")
    labels = [s.strip() for s in (args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)).split(",") if s.strip()]
    specs = [(label, GenSpec(ranks=args.ranks, size=parse_size(label), seed=args.seed, failure=FailureKind(args.failure),
                             fail_at=args.fail_at, style=Style(args.style))) for label in labels]
    specs.sort(key=lambda item: item[1].size)
    scratch = args.scratch.resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    triage = triage_command(args.triage)
    machine = describe_machine(REPO)
    patterns = grep_patterns(triage, REPO, scratch / "grep-patterns.txt")
    notes = [patterns.warning] if patterns.warning else []
    if patterns.warning:
        _say(f"warning: {patterns.warning}")
    if args.pairs < 5:
        notes.append(f"only {args.pairs} pair(s) per size: the targets ask for the median of at least 5")
    sizes = []
    for label, spec in specs:
        log, expect = ensure_log(spec, scratch)
        sizes.append(measure_size(label, log, expect, args, triage, patterns.path, scratch))
    for r in sizes:
        for name, series in (("grep", r.grep), ("triage", r.triage)):
            if series.failures:
                bad = series.failures[0]
                notes.append(f"{name} failed {len(series.failures)} of {len(series.runs)} runs on {r.label} "
                             f"(exit {bad.returncode}: {bad.stderr_tail or 'no message'}); its times are not comparable")
    rules = None
    if not args.no_rules:
        label, spec = specs[-1]
        rules = measure_rules(label, ensure_log(spec, scratch)[0], args, triage, scratch)
    shown = " ".join("python" if part == sys.executable else Path(part).name if part == triage[0] else part
                     for part in triage)
    commands = (
        f"python benchmarks/generate.py {specs[-1][1].args_line('SIZE')} --out LOG",
        "cat LOG > /dev/null",
        f"{shown} --format json LOG > OUT      # a file: grep stops at the first match into /dev/null",
        "grep -cEf PATTERNS LOG > OUT    # PATTERNS: " + ("`triage catalog grep-patterns`" if patterns.from_catalog
                                                          else "the runner's built-in list"),
        f"{shown} --format json --patterns RULES_DIR LOG > OUT   # the rules case",
    )
    result = BenchResult(machine, specs[-1][1].args_line("SIZE"),
                         args.pairs, args.quick, tuple(sizes), rules, patterns.count, tuple(notes), commands)
    section = render(result)
    print(section)
    if not args.no_write:
        update_doc(args.doc, section)
        _say(f"wrote the results into {args.doc.relative_to(REPO) if args.doc.is_relative_to(REPO) else args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
