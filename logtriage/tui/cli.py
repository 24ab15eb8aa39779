"""Browse a failed run rank by rank: verdict and root cause on top, every stream with its status,
the selected stream's log with findings highlighted, the causal chain below.

    triage tui run.log                    opens on the root-cause rank, its failing line in view
    triage tui logs/                      a torchrun --log-dir tree or per-rank files
    torchrun ... 2>&1 | triage tui -      standard input, shown as it arrives (t follows it)
    triage tui run.log --follow           follow a file that is still being written

The first lines show at once; the line index and the triage run in the background (progress on
the status line) and the view jumps to the root cause when they are done. Lines are read from
the file as they are shown, so a multi-gigabyte log costs its line index, not its text.
"""

from __future__ import annotations

import argparse
import sys

from logtriage.errors import UsageError
from logtriage.ingest.sources import discover
from logtriage.tui.model.keys import keys_help

__doc__ = __doc__ + "\n" + keys_help()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="*", metavar="LOG", help="log files, folders, .gz, or - for stdin")
    parser.add_argument("--follow", action="store_true", help="start in tail mode (the t key)")
    parser.add_argument("--patterns", action="append", default=[], metavar="DIR",
                        help="an extra rules directory (repeatable; also LOGTRIAGE_PATTERNS)")
    parser.add_argument("--no-redact", action="store_true",
                        help="export the report without masking tokens, keys and passwords")


def run(args: argparse.Namespace) -> int:
    from logtriage.tui.model.session import Settings, resolve
    from logtriage.tui.model.spool import spool_stdin

    inputs = list(args.inputs)
    if not inputs:
        if sys.stdin.isatty():
            raise UsageError("give a log file, a folder, or pipe a log into `triage tui -` (see --help)")
        inputs = ["-"]
    if "-" in inputs and sys.stdin.isatty():
        raise UsageError("standard input is the terminal: pipe a log into `triage tui -`")
    named = [name for name in inputs if name != "-"]
    if named:
        discover(named)                    # a missing or unreadable input: InputError, before the screen
    if not sys.stdout.isatty():
        raise UsageError("triage tui draws on a terminal; for a report use `triage LOG`")
    stdin = spool_stdin() if "-" in inputs else None
    try:
        resolved = resolve(inputs, stdin)
    except BaseException:
        if stdin is not None:
            stdin.remove()
        raise
    try:
        from logtriage.tui.app import TriageApp
        TriageApp(resolved, Settings(tuple(args.patterns), not args.no_redact), follow=args.follow).run()
    finally:
        resolved.close()
    return 0
