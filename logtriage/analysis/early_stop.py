"""A rank that decided alone to stop early (an early-stopping callback fed its own metric, a stop
condition on its own data) and exited cleanly leaves its peers in a collective it never calls: they
lose the connection (`Connection closed by peer`). With two ranks, `peer_that_left` reads the one
waiting rank as the one that called an extra collective; when the clean rank's own last words say it
stopped early (`EarlyStopping: ... stopping at epoch 1`, `early stop at step 40`), it is the one that
went its own way."""

from __future__ import annotations

import re
from dataclasses import replace

from logtriage.analysis.last_lines import pieces_before
from logtriage.analysis.rank_evidence import PEER_LEFT_RULES
from logtriage.analysis.roots import RankFacts, RootCause
from logtriage.demux.streams import StreamKey
from logtriage.scan_result import ScanResult

# `EarlyStopping: ... stopping`, `early stop triggered`, `early-stopping at epoch 3`, `stopping early`,
# `stopping training at epoch 2` (a stop the rank's own condition took, not a failure's teardown)
STOPPED_EARLY = re.compile(
    r"\bearly[ _-]?stop|\bstop(?:ped|ping)? early\b|\bstopping (?:training )?at (?:epoch|step|iter)", re.IGNORECASE)


def stopped_early_peer(scan: ScanResult, keys: list[StreamKey], root: RootCause, facts: RankFacts) -> RootCause:
    """A lost peer blamed on a waiting rank moves to the one rank that exited cleanly after saying it
    stopped early."""
    lost = root.finding
    if lost is None or root.rule.id not in PEER_LEFT_RULES or lost.source >= len(scan.sources):
        return root
    clean = facts.completed - {root.rank}
    said: dict[int, str] = {}
    for _, _, rank, piece in pieces_before(scan, keys, lost.source, lost.line):
        if rank in clean and STOPPED_EARLY.search(piece):
            said[rank] = piece.strip()
    if len(said) != 1:
        return root
    rank, text = next(iter(said.items()))
    return replace(root, rank=rank, ranks=(rank,), confidence=min(root.confidence, 0.4), reasons=root.reasons + (
        f"rank {rank} said it stopped early (`{text[:120]}`) and exited cleanly, while rank {root.rank} went on "
        "into a collective it no longer called: the rank that stopped alone left its peer waiting",))
