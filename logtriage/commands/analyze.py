"""Report why a distributed PyTorch run failed, from its console log.

    triage run.log                      text report (colour on a terminal; NO_COLOR honoured)
    torchrun ... 2>&1 | triage -        from standard input (also when stdin is piped)
    triage logs/ --format json          a torchrun --log-dir tree or a folder of per-rank files
    triage run.log.gz --format md -o incident.md
    torchrun ... 2>&1 | triage --follow -   findings as they happen, the report when the run ends

Line numbers are 1-based within each input file; for a folder, every cited line names its file.
"""

from __future__ import annotations

import argparse
import os
import sys

from logtriage.api import TriageOptions, run_triage
from logtriage.errors import InputError, UsageError
from logtriage.report import FORMATS, render


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="*", metavar="LOG", help="log files, folders, .gz, or - for stdin")
    parser.add_argument("-f", "--format", choices=FORMATS, default="text")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the report to FILE instead of stdout")
    parser.add_argument("--patterns", action="append", default=[], metavar="DIR",
                        help="an extra rules directory (repeatable; also LOGTRIAGE_PATTERNS)")
    parser.add_argument("--strict-catalog", action="store_true", help="stop on a malformed rule file")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    parser.add_argument("--no-redact", action="store_true", help="do not mask tokens, keys and passwords")
    parser.add_argument("--redact", default="", metavar="hosts,paths,ips",
                        help="also mask host names, user names in home paths, IP addresses")
    parser.add_argument("--follow", action="store_true",
                        help="follow one growing file or a pipe (-): print each finding as its line "
                             "arrives, the report when the input ends or on Ctrl-C")


def run(args: argparse.Namespace) -> int:
    inputs = list(args.inputs)
    if not inputs:
        if sys.stdin.isatty():
            raise UsageError("give a log file, a folder, or pipe a log into `triage -` (see --help)")
        inputs = ["-"]
    extra = tuple(x.strip() for x in args.redact.split(",") if x.strip())
    bad = set(extra) - {"hosts", "paths", "ips"}
    if bad:
        raise UsageError(f"--redact takes hosts, paths, ips (got {', '.join(sorted(bad))})")
    options = TriageOptions(tuple(args.patterns), args.strict_catalog, not args.no_redact, extra,
                            progress=None if args.follow else _progress_bar())
    if args.follow:
        if len(inputs) != 1:
            raise UsageError("--follow takes one file, or - for standard input")
        from logtriage.follow import follow
        report, unreadable = follow(inputs[0], options, sys.stdout, sys.stderr), []
        if not args.output:
            sys.stdout.write("\n")
    else:
        run = run_triage(inputs, options)
        if run.scan.unreadable and not run.scan.input_lines:
            raise InputError("; ".join(run.scan.unreadable))   # nothing was readable: no "OK" report
        report, unreadable = run.report, run.scan.unreadable
    color = args.color == "always" or (args.color == "auto" and not args.output and sys.stdout.isatty()
                                       and not os.environ.get("NO_COLOR"))
    text = render(report, args.format, color=color)
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as out:
                out.write(text)
        except OSError as exc:
            raise UsageError(f"{args.output}: cannot write the report ({exc.strerror or exc})") from None
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    # A corrupt or truncated input still gets its report (on the lines before the damage), then
    # the exit code says the input was not wholly readable.
    for problem in unreadable:
        print(f"triage: warning: {problem}; the report covers the lines before it", file=sys.stderr)
    return InputError.exit_code if unreadable else 0


def _progress_bar():
    if not sys.stderr.isatty():
        return None
    from logtriage.progress import ProgressBar
    return ProgressBar(sys.stderr)
