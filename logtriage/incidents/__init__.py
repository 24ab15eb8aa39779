"""Incident records: triaged failures stored in SQLite, repeats grouped by fingerprint.

    from logtriage.incidents import IncidentStore, record_logs
    draft = record_logs(["run.log"], run_id="job-4812", tags=[("cluster", "a100")])
    with IncidentStore.open("incidents.db") as store:
        result = store.add(draft)        # result.outcome: new | repeat | regression

A client of the library: nothing else in logtriage imports this package.
"""

from logtriage.incidents.models import (AddOutcome, AddResult, Event, EventKind, Fingerprint, Incident, IncidentFilter,
                                        IncidentRecord, Occurrence, OccurrenceDraft, Status)
from logtriage.incidents.recording import NothingToRecord, draft_from_report, record_logs
from logtriage.incidents.store import IncidentStore, default_db_path

__all__ = ["AddOutcome", "AddResult", "Event", "EventKind", "Fingerprint", "Incident", "IncidentFilter",
           "IncidentRecord", "IncidentStore", "NothingToRecord", "Occurrence", "OccurrenceDraft", "Status",
           "default_db_path", "draft_from_report", "record_logs"]
