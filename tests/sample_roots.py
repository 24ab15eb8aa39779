"""The real CPU runs' folder, and a run's report and diagnosis in the shapes the batch test files compare."""

from __future__ import annotations

from pathlib import Path

from logtriage.api import triage

SAMPLES = Path(__file__).resolve().parent.parent / "sample_logs" / "cpu_adhoc"


def sample_report(slug: str) -> dict:
    """The JSON report of sample_logs/cpu_adhoc/<slug>.log."""
    return triage([str(SAMPLES / f"{slug}.log")]).to_dict()


def root_cause(slug: str) -> dict:
    """The report's root_cause object."""
    return sample_report(slug)["root_cause"]


def root_facts(slug: str) -> tuple:
    """(rule, category, rank, line, exception_type) of the root cause."""
    return facts_of(sample_report(slug))


def facts_of(report: dict) -> tuple:
    """(rule, category, rank, line, exception_type) of a report's root cause."""
    rc = report["root_cause"]
    return rc["rule_id"], rc["category"], rc["rank"], rc["line"], rc["exception_type"]


def verdict_and_root(slug: str) -> tuple:
    """(verdict, rule, category, rank)."""
    report = sample_report(slug)
    rc = report["root_cause"]
    return report["verdict"], rc["rule_id"], rc["category"], rc["rank"]


def edited_report(slug: str, old: str, new: str, folder: Path) -> dict:
    """The JSON report of a copy of sample_logs/cpu_adhoc/<slug>.log, written into `folder`, whose every `old`
    is `new` (the run as it would have been had one line said otherwise)."""
    text = (SAMPLES / f"{slug}.log").read_text()
    assert old in text
    log = folder / f"{slug}.edited.log"
    log.write_text(text.replace(old, new))
    return triage([str(log)]).to_dict()


def text_root(text: str, folder: Path) -> dict:
    """The root_cause object of a log whose whole text is `text`, written into `folder`."""
    log = folder / "run.log"
    log.write_text(text)
    return triage([str(log)]).to_dict()["root_cause"]
