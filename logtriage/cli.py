"""The `triage` command: a thin layer over the library.

    triage LOG...                 report the root cause of a failed run (text, md or json)
    triage SUBCOMMAND ...         catalog, explain, test, probe, inject, lint, incident, tui

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their command runs, so a plain
``triage LOG`` never imports Textual, pandas or torch. Library errors (``TriageError``)
become a one-line message and an exit code here and nowhere else.
"""

from __future__ import annotations

import _thread
import argparse
import importlib
import os
import signal
import sys
import threading

from logtriage.errors import TriageError

EXIT_CODES = """exit codes:
  0    a report was produced (whatever the verdict), or the subcommand succeeded
  1    subcommand-specific failure (triage test: a case failed; lint: findings at --fail-on)
  2    bad usage: unknown option, bad value
  3    unreadable input: missing file, permission denied, corrupt .gz, a directory with no logs
       (a corrupt or truncated .gz still gets its report, on the lines before the damage)
  4    a rule file in the catalog is malformed (with --strict-catalog, or `triage catalog check`)
  5    the incident store cannot be opened or written
  130  interrupted (Ctrl-C)"""

# name -> (module, one-line help). Modules expose add_arguments(parser) and run(args).
COMMANDS: dict[str, tuple[str, str]] = {
    "analyze": ("logtriage.commands.analyze", "report the root cause of a failed run (the default)"),
    "catalog": ("logtriage.catalog.cli", "list or check the error catalog"),
    "explain": ("logtriage.commands.explain", "print a rule's explanation, fix and misdiagnosis"),
    "test": ("logtriage.regress.cli", "regression-test the catalog against captured logs"),
    "probe": ("logtriage.commands.probe", "print a LOGTRIAGE_ENVIRONMENT_JSON= line for job logs"),
    "inject": ("logtriage.inject.cli", "run fault-injection scenarios under torchrun"),
    "lint": ("logtriage.lint.cli", "check training code and launch scripts for known hang/crash patterns"),
    "incident": ("logtriage.incidents.cli", "store reports as incident records and group repeats"),
    "tui": ("logtriage.tui.cli", "browse a failed run rank by rank"),
}


def _build_parser(name: str) -> tuple[argparse.ArgumentParser, object]:
    module_name, help_text = COMMANDS[name]
    module = importlib.import_module(module_name)
    prog = "triage" if name == "analyze" else f"triage {name}"
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(module.__doc__ or help_text).strip(),
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(parser)
    return parser, module


def _top_help() -> str:
    lines = ["usage: triage [OPTIONS] LOG... | triage COMMAND ...", "", "commands:"]
    for name, (_, help_text) in COMMANDS.items():
        if name != "analyze":
            lines.append(f"  {name:<10} {help_text}")
    lines += ["", "Run `triage --help-analyze` or `triage analyze --help` for the report options,",
              "`triage COMMAND --help` for a command.", "", EXIT_CODES]
    return "\n".join(lines)




def _quiet_interrupts() -> None:
    """Ctrl-C reaches every process of the terminal's group: forked worker processes (the fast
    scan's) leave it to this one, and a KeyboardInterrupt that lands inside a C callback (numba
    compiling) is delivered again where it can stop the run, instead of printing "Exception
    ignored" with a traceback."""
    main_pid = os.getpid()
    interrupted = []

    def on_sigint(signum, frame):
        if os.getpid() != main_pid:
            return
        interrupted.append(True)
        raise KeyboardInterrupt

    default_hook = sys.unraisablehook

    def on_unraisable(unraisable):
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            # not from here: the hook is Python code, the interrupt would land in it again
            threading.Timer(0.05, _thread.interrupt_main).start()
            return
        if interrupted:
            # an object the interrupt left half-built (multiprocessing's Finalize) fails as it is
            # collected: a side effect of stopping, not something to show
            return
        default_hook(unraisable)

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        try:
            signal.signal(signal.SIGINT, on_sigint)
        except OSError:   # a Ctrl-C raced the installation: Python raises KeyboardInterrupt instead
            pass
    sys.unraisablehook = on_unraisable


def entry() -> None:
    """The `triage` command. After Ctrl-C the process leaves at once: the fast scan has killed its
    workers, and the interpreter's exit would otherwise wait on the worker pool's threads, which
    an interrupt can leave blocked for good."""
    code = main()
    if code == 130:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(130)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # A closed pipe (`triage big.log | head`) ends quietly.
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    _quiet_interrupts()
    if argv and argv[0] in ("-h", "--help"):
        print(_top_help())
        return 0
    if argv and argv[0] == "--help-analyze":
        argv = ["analyze", "--help"]
    name = argv[0] if argv and argv[0] in COMMANDS else "analyze"
    rest = argv[1:] if argv and argv[0] in COMMANDS else argv
    try:
        parser, module = _build_parser(name)
        try:
            args = parser.parse_args(rest)
        except SystemExit as exc:  # argparse already printed its message
            return 0 if exc.code in (0, None) else 2
        return int(module.run(args) or 0)
    except TriageError as exc:
        print(f"triage: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("triage: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout went away; silence the flush at exit as well.
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
