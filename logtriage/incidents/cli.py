"""Keep triaged failures as incident records: repeats of one failure are grouped and counted.

    triage incident add run.log --run-id job-4812 --tag cluster=a100 --link https://tracker/T-91
    triage incident list --status open --since 7d
    triage incident show 3
    triage incident export 3 --format md -o incident-3.md
    triage incident resolve 3 --note "raised TORCH_NCCL timeout; bad node drained"
    triage incident stats --by rule --period week --csv weekly.csv

The store is an SQLite file: --db PATH, else $LOGTRIAGE_DB, else incidents.db in the user data
directory. Reports are redacted before they are stored (--no-redact keeps them as they are, and
the record says so); --redact hosts,paths,ips masks more.
"""

from __future__ import annotations

import argparse
import re
import sys
from datetime import datetime, timedelta, timezone

from logtriage.errors import UsageError
from logtriage.incidents.models import AddOutcome, AddResult, IncidentFilter, Status

SUBCOMMANDS = ("add", "list", "show", "export", "resolve", "reopen", "stats", "check")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", metavar="PATH", help="incident database (default: $LOGTRIAGE_DB or the user data dir)")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    db = argparse.ArgumentParser(add_help=False)
    db.add_argument("--db", metavar="PATH", default=argparse.SUPPRESS, help="incident database")

    p = sub.add_parser("add", parents=[db], help="triage logs and record the failure (grouped with its repeats)")
    p.add_argument("inputs", nargs="+", metavar="LOG", help="the logs of one run (files, folders, .gz)")
    p.add_argument("--title", help="title for a new incident (default: the root cause)")
    p.add_argument("--tag", action="append", default=[], metavar="K=V", help="a tag (repeatable)")
    p.add_argument("--link", action="append", default=[], metavar="URL", help="a link: job, tracker issue (repeatable)")
    p.add_argument("--run-id", metavar="ID", help="the job or run id")
    p.add_argument("--no-redact", action="store_true", help="store the report unredacted (the record says so)")
    p.add_argument("--redact", default="", metavar="hosts,paths,ips", help="also mask these before storing")
    p.add_argument("--patterns", action="append", default=[], metavar="DIR", help="an extra rules directory")

    p = sub.add_parser("list", parents=[db], help="list incidents, most recently seen first")
    p.add_argument("--category")
    p.add_argument("--rule", metavar="RULE_ID")
    p.add_argument("--tag", action="append", default=[], metavar="K=V", help="seen with this tag (repeatable: all)")
    p.add_argument("--status", choices=[s.value for s in Status])
    p.add_argument("--since", metavar="DATE", help="last seen since: YYYY-MM-DD, an ISO time, or 7d / 12h / 2w")
    p.add_argument("--limit", type=int, metavar="N")

    p = sub.add_parser("show", parents=[db], help="an incident, its history and its occurrences")
    p.add_argument("id", type=int)

    p = sub.add_parser("export", parents=[db], help="the whole record, every occurrence with its report")
    p.add_argument("id", type=int)
    p.add_argument("-f", "--format", choices=("md", "json"), default="md")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")

    p = sub.add_parser("resolve", parents=[db], help="mark an incident resolved")
    p.add_argument("id", type=int)
    p.add_argument("--note", help="what fixed it")

    p = sub.add_parser("reopen", parents=[db], help="mark a resolved incident open again")
    p.add_argument("id", type=int)
    p.add_argument("--note")

    p = sub.add_parser("stats", parents=[db], help="occurrence counts by category or rule over time (pandas)")
    p.add_argument("--by", choices=("category", "rule"), default="category")
    p.add_argument("--period", choices=("day", "week", "month"), default="week")
    p.add_argument("--since", metavar="DATE")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--csv", metavar="FILE", help="write the long table (period, key, counts) as CSV")
    out.add_argument("--parquet", metavar="FILE", help="write it as Parquet (needs pyarrow)")

    sub.add_parser("check", parents=[db], help="verify the database: SQLite integrity and the store's counts")


def run(args: argparse.Namespace) -> int:
    from logtriage.incidents.store import IncidentStore
    action = args.action
    if action == "add":
        draft = _draft(args)         # triage before opening the store: no lock held while reading logs
        with IncidentStore.open(args.db) as store:
            print(describe_add(store.add(draft)))
        return 0
    with IncidentStore.open(args.db) as store:
        if action == "list":
            from logtriage.incidents.render import incident_table
            flt = IncidentFilter(args.category, args.rule, _tags(args.tag), Status(args.status) if args.status else None,
                                 parse_since(args.since), args.limit)
            sys.stdout.write(incident_table(store.list(flt)))
        elif action == "show":
            from logtriage.incidents.render import record_text
            sys.stdout.write(record_text(store.get(args.id)))
        elif action == "export":
            from logtriage.incidents.export import export
            _emit(export(store.get(args.id, with_reports=True), args.format), args.output)
        elif action == "resolve":
            incident = store.resolve(args.id, args.note)
            print(f"incident {incident.id} resolved" + (f": {args.note}" if args.note else ""))
        elif action == "reopen":
            incident = store.reopen(args.id, args.note)
            print(f"incident {incident.id} reopened ({incident.occurrence_count} occurrences so far)")
        elif action == "stats":
            from logtriage.incidents.stats import occurrence_stats, pivot_text, write_table
            table = occurrence_stats(store.occurrence_rows(parse_since(args.since)), args.by, args.period)
            sys.stdout.write(pivot_text(table, args.period))
            write_table(table, args.csv, args.parquet)
            if args.csv or args.parquet:
                print(f"wrote {len(table)} rows to {args.csv or args.parquet}")
        elif action == "check":
            problems = store.problems()
            for problem in problems:
                print(problem)
            print(f"{store.path}: " + ("ok" if not problems else f"{len(problems)} problem(s)"))
            return 1 if problems else 0
    return 0


def _draft(args: argparse.Namespace):
    from logtriage.incidents.recording import parse_extras, parse_tags, record_logs
    return record_logs(args.inputs, title=args.title, tags=parse_tags(args.tag), links=args.link, run_id=args.run_id,
                       redact=not args.no_redact, redact_extra=parse_extras(args.redact), patterns_dirs=args.patterns)


def _tags(values: list[str]) -> tuple[tuple[str, str], ...]:
    from logtriage.incidents.recording import parse_tags
    return parse_tags(values)


def _emit(text: str, output: str | None) -> None:
    if output:
        try:
            with open(output, "w", encoding="utf-8") as out:
                out.write(text)
        except OSError as exc:
            raise UsageError(f"cannot write {output}: {exc}") from exc
    else:
        sys.stdout.write(text)


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def describe_add(result: AddResult) -> str:
    inc = result.incident
    head = f"incident {inc.id} ({result.outcome.value}): {inc.title}"
    if result.outcome is AddOutcome.NEW:
        return f"{head}\n1st occurrence; recorded as occurrence {result.occurrence_id}"
    previous = ", ".join(f"{o.label} ({o.added_at:%Y-%m-%d %H:%M})" for o in result.previous)
    more = inc.occurrence_count - 1 - len(result.previous)
    lines = [head, f"{ordinal(inc.occurrence_count)} occurrence; previous runs: {previous}"
             + (f" and {more} more" if more > 0 else "")]
    if result.outcome is AddOutcome.REGRESSION:
        when = result.last_resolution.at.strftime("%Y-%m-%d") if result.last_resolution else "earlier"
        note = f" ({result.last_resolution.note})" if result.last_resolution and result.last_resolution.note else ""
        lines.append(f"regression: it was resolved {when}{note}; reopened")
    return "\n".join(lines)


_RELATIVE = re.compile(r"^(\d+)\s*([hdw])$")


def parse_since(value: str | None, now: datetime | None = None) -> datetime | None:
    if not value:
        return None
    now = now or datetime.now(timezone.utc)
    m = _RELATIVE.match(value.strip().lower())
    if m:
        unit = {"h": "hours", "d": "days", "w": "weeks"}[m.group(2)]
        return now - timedelta(**{unit: int(m.group(1))})
    try:
        moment = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError as exc:
        raise UsageError(f"--since takes YYYY-MM-DD, an ISO time, or 7d / 12h / 2w (got {value!r})") from exc
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)
