"""What a rank's last lines say when the output stops with nothing failed: that it is done (`rank 3 done: 20
steps, mean loss 1.4187`), or a result every rank printed alike after its steps (`rank N: recall@5 0.1146`): the
program ended, and the launcher, at its default log level, prints nothing on success."""

from __future__ import annotations

import re

from logtriage.analysis.findings import mask_numbers
from logtriage.analysis.roots import RankFacts
from logtriage.demux.line_marks import OWN_RANK
from logtriage.scan_result import step_number

# a rank's own last word that its work is over (`rank 0 final 11.1705 done`, `[r2] eval finished`)
# a last line that ends on the word, or that sums the run up after it (`rank 3 done: 20 steps, mean loss
# 1.4187`, `finished, final loss 1.37`, `done, best f1 0.7222`, `done samples 256`, `done 8 steps 0.41 loss`:
# only counts and their names to the line's end; a name of up to three words, a value with a sign: `done: 5
# updates, mean return -0.300`, `done: precision 1.000 recall 0.379, 11 windows flagged on 3 machines`); not one
# that goes on to wait (`done, waiting for the report`); or that it finished its run or its model (`rank 0 finished
# quill stroke trainer run`, `finished training`, `rank 0 finished chamber classifier`: cpu_adhoc 522nd, 586th batches)
_COUNT = r"(?:[a-z_]+(?:\s+[a-z_]+){0,2}\s*[=:]?\s*[-+]?\d[\d.,]*|\d[\d.,]*\s+[a-z_]+(?:\s+[a-z_]+){0,2})"
SIGNED_OFF = re.compile(r"\b(?:done|finished|completed?|exiting)[.!]?\s*$|\b(?:done|finished|completed?)[:,]\s+"
                        r"(?:\d+\s+(?:steps?|epochs?|iterations?|iters?|batches)\b|(?:final|mean|avg|average|last|best)"
                        r"\s+(?:(?:loss|acc(?:uracy)?|metric)\b|[a-z][\w@-]*\s*[=:]?\s*[-+]?\d[\d.]*\s*$))"
                        rf"|\b(?:done|finished|completed?)[:,]?\s+(?!.*\b(?:wait\w*|retr\w*|error|fail\w*|timed? ?out|stuck)\b)"
                        rf"{_COUNT}(?:[,;]?\s+{_COUNT})*[.]?\s*$"
                        r"|\b(?:finished|completed)\s+(?:(?:the|its|a)\s+)?(?:[a-z][\w-]*\s+){0,4}"
                        r"(?:run|training|job|model|classifier|regressor|network)[.!]?\s*$",
                        re.IGNORECASE)
# a line that sums a finished run up (`final val_loss 0.2204`, `best acc 0.91`), and says nothing of errors
_SUMMED_UP = re.compile(r"^(?!.*\b(?:error|fail\w*|warn\w*|wait\w*|timed? ?out)\b).*\b(?:final|total|best|summary)\b",
                        re.IGNORECASE)


def every_rank_signed_off(ranked: list[tuple[str, int | None]], facts: RankFacts) -> bool:
    """Every known rank's last line in the log's end (`ranked`: each line's message and rank) says it is done, or
    sums the run up after a line that did: each rank finished its script (and the launcher, at its default log
    level, prints nothing on success)."""
    signed: dict[int, bool] = {}
    for message, rank in ranked:
        if rank is not None:
            # a sum-up after the word (`done`, then `final val_loss 0.22`) keeps the rank signed off
            signed[rank] = bool(SIGNED_OFF.search(message)) or (
                signed.get(rank, False) and bool(_SUMMED_UP.search(message)))
    return bool(facts.known) and facts.known <= signed.keys() and all(signed[rank] for rank in facts.known)


# a result's name and value (`recall@5 0.1146`, `val_acc=0.91`, `mpjpe: 41.2`)
_RESULT = re.compile(r"\b[a-z][\w@./-]*\s*[=:]?\s*[-+]?\d")


def every_rank_reported_its_result(ranked: list[tuple[str, int | None]], facts: RankFacts) -> bool:
    """Every known rank's last line in the log's end is the same result after its progress lines, numbers aside
    (`rank 0: recall@5 0.1146 (global hits 22/192)` on every rank, after each one's last step), and says nothing of
    errors or waiting: each rank reached its script's last print (a result every rank computes together)."""
    last: dict[int, str] = {}
    stepped = False
    for message, rank in ranked:
        stepped = stepped or step_number(message) is not None
        if rank is not None and stepped:
            last[rank] = message
    if len(facts.known) < 2 or not facts.known <= last.keys():
        return False
    texts = {mask_numbers(last[rank]) for rank in facts.known}
    text = last[min(facts.known)]
    return len(texts) == 1 and step_number(text) is None and bool(_RESULT.search(
        OWN_RANK.sub("", text))) and _NO_TROUBLE.match(text) is not None


# nothing of errors, waiting or a timeout in a line, no work under way (`evaluating 8 batches`, `done loading`), and
# no word of being done, which the sign-off reading (SIGNED_OFF) judges
_NO_TROUBLE = re.compile(r"^(?!.*\b(?:error|fail\w*|warn\w*|wait\w*|timed? ?out|retr\w*|stuck|skipp\w*|done|"
                         r"finished|completed?|[a-z]{2,}ing)\b)", re.IGNORECASE)
