"""Turn a failed run's logs into an OccurrenceDraft: triage, fingerprint, redact, render.

The fingerprint is computed from the unredacted root-cause line (its own masking hides volatile
and secret-looking parts), so a redacted and a `--no-redact` record of the same failure group
together. Everything stored is redacted first, unless the caller turned redaction off.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from logtriage.api import TriageOptions, triage
from logtriage.errors import TriageError, UsageError
from logtriage.incidents.fingerprint import all_fingerprints, strip_prefixes
from logtriage.incidents.models import Fingerprint, OccurrenceDraft
from logtriage.redact import EXTRAS, Redactor, redact_report
from logtriage.report import render
from logtriage.report.model import Report

MAX_TITLE = 120


class NothingToRecord(TriageError):
    """Triage found no failure in the logs: there is no root cause to group by."""


def parse_tags(values: Sequence[str]) -> tuple[tuple[str, str], ...]:
    tags = []
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--tag takes KEY=VALUE (got {value!r})")
        tags.append((key.strip(), val.strip()))
    return tuple(tags)


def parse_extras(value: str) -> tuple[str, ...]:
    extra = tuple(x.strip() for x in value.split(",") if x.strip())
    bad = set(extra) - set(EXTRAS)
    if bad:
        raise UsageError(f"--redact takes {', '.join(EXTRAS)} (got {', '.join(sorted(bad))})")
    return extra


def record_logs(paths: Sequence[str], *, title: str | None = None, tags: Sequence[tuple[str, str]] = (),
                links: Sequence[str] = (), run_id: str | None = None, redact: bool = True,
                redact_extra: Sequence[str] = (), patterns_dirs: Sequence[str] = ()) -> OccurrenceDraft:
    report = triage(list(paths), TriageOptions(tuple(patterns_dirs), redact=False))
    return draft_from_report(report, title=title, tags=tags, links=links, run_id=run_id, redact=redact,
                             redact_extra=redact_extra)


def draft_from_report(report: Report, *, title: str | None = None, tags: Sequence[tuple[str, str]] = (),
                      links: Sequence[str] = (), run_id: str | None = None, redact: bool = True,
                      redact_extra: Sequence[str] = ()) -> OccurrenceDraft:
    """`report` must be unredacted (triage with redact=False): it is redacted here, after fingerprinting."""
    rc = report.root_cause
    if rc is None:
        raise NothingToRecord(f"triage found no failure in {', '.join(report.sources) or 'the input'} "
                              f"(verdict {report.verdict}): nothing to record")
    fingerprints = all_fingerprints(rc.rule_id, rc.category, rc.text)
    extra = tuple(redact_extra)
    clean = _identity
    if redact:
        redactor = Redactor(extra)
        report = replace(redact_report(report, redactor), redaction={"enabled": True, "extra": list(extra)})
        clean = redactor.redact
        # The basis is masked already; passing it through the redactor too keeps the promise
        # that nothing stored escaped it (a password is not a volatile part).
        fingerprints = tuple(Fingerprint(fp.version, fp.hash, Redactor(EXTRAS).redact(fp.basis))
                             for fp in fingerprints)
    else:
        report = replace(report, redaction={"enabled": False})
    rc = report.root_cause
    evidence = "\n".join(f"{'>' if e.is_match else ' '} {e.source}:{e.line}: {e.text}" for e in rc.evidence)
    return OccurrenceDraft(
        fingerprints=fingerprints, rule_id=rc.rule_id, category=rc.category, verdict=report.verdict, rank=rc.rank,
        ranks=tuple(rc.ranks), root_text=rc.text, default_title=_title(rc.title, rc.text), evidence=evidence,
        report_json=render(report, "json"), report_md=render(report, "md"), sources=tuple(report.sources),
        redacted=redact, redact_extra=extra if redact else (), title=clean(title) if title else None,
        run_id=clean(run_id) if run_id else None, tags=tuple((clean(k), clean(v)) for k, v in tags),
        links=tuple(clean(url) for url in links))


def _title(rule_title: str, text: str) -> str:
    line = " ".join(strip_prefixes(text).split())
    title = f"{rule_title}: {line}" if line else rule_title
    return title if len(title) <= MAX_TITLE else title[:MAX_TITLE - 1] + "…"


def _identity(text: str) -> str:
    return text
