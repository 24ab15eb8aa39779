"""A log with no error, no exit status and no line saying the run finished: its output simply
stops. The issue's rule is that such output is a hang (with each rank's last progress line), not a
healthy run; a log that does not look like a training log at all (binary noise, bare prefixes)
stays OK, since nothing in it says a job ran."""

from __future__ import annotations

import re

from logtriage.analysis.findings import Finding
from logtriage.analysis.hangs import fallback_rule
from logtriage.analysis.roots import RankFacts, RootCause
from logtriage.catalog.loader import Catalog
from logtriage.catalog.rule import Category
from logtriage.demux.streams import StreamKey
from logtriage.ingest.lines import read_lines
from logtriage.scan import ScanResult

FINISHED_RULE = "context.run_finished"
TAIL_LINES = 40

# What makes a line a training job's output rather than noise: a log record's stamp or level, or
# the vocabulary of distributed training.
_JOB_OUTPUT = re.compile(
    r"\d{4}-\d\d-\d\d|\d\d:\d\d:\d\d|\b(?:INFO|WARNING|WARN|DEBUG)\b|"
    r"torch|nccl|gloo|cuda|gpu|rank|distributed|deepspeed|lightning|accelerate|epoch|\bstep\b|"
    r"\biter|\bloss\b|train|dataset|dataloader|checkpoint|model",
    re.IGNORECASE)
# ProcessGroupNCCL's note that destroy_process_group ran: the program reached its end
_SHUTDOWN = re.compile(r"Process Group shutdown on rank \d+")
_PREFIX_ONLY = re.compile(r"^(?:\s*(?:\[[^\]]{0,40}\]|<std(?:out|err)>|\d+):?)*\s*$")


def output_stopped(scan: ScanResult, keys: list[StreamKey], findings: list[Finding], facts: RankFacts,
                   catalog: Catalog) -> RootCause | None:
    """The hang the log's end implies when nothing failed and nothing says the run finished."""
    if scan.unreadable or facts.completed or any(f.rule.id == FINISHED_RULE or _SHUTDOWN.search(f.text)
                                                  for f in findings):
        return None
    last = _last_job_line(scan)
    if last is None:
        return None
    source, number, text = last
    index = scan.indexes[source]
    stream = keys[scan.slots.final(index.slots[number - 1])]
    rule = catalog.get("hang.output_stopped") or fallback_rule(
        "hang.output_stopped", Category.HANG, "The output stops: no error, no exit and no line saying the run finished")
    finding = Finding(rule, {}, source, number, stream, stream.rank_or_none, text.strip(), -1, scan.seq + 1, None)
    reasons = [f"no error, no exit status and no line saying the run finished: the output stops at line {number}"]
    if facts.last_step:
        low, high = min(facts.last_step.values()), max(facts.last_step.values())
        reasons.append(f"the ranks' last progress lines reached step {low}" if low == high
                       else f"the ranks' last progress lines reached steps {low}-{high}")
    else:
        reasons.append("no training step was printed: it stopped during start-up")
    reasons.append("if the job is still running it is stuck after this line; if it ended, its end is not in this log")
    ranks = tuple(sorted(facts.last_step))
    return RootCause(rule, finding, None, ranks if len(ranks) > 1 else (), 0.25, tuple(reasons))


def _last_job_line(scan: ScanResult) -> tuple[int, int, str] | None:
    """(source, line, text) of the last line that reads as a job's output, looking only at each
    input's last lines: the newest input first."""
    for source in range(len(scan.sources) - 1, -1, -1):
        total = len(scan.indexes[source].offsets)
        if not total:
            continue
        numbers = list(range(max(1, total - TAIL_LINES + 1), total + 1))
        texts = read_lines(scan.sources[source], scan.indexes[source], numbers)
        for number in reversed(numbers):
            text = texts.get(number, "")
            if not _PREFIX_ONLY.match(text) and _JOB_OUTPUT.search(text):
                return source, number, text
    return None
