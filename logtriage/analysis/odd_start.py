"""Ranks that start alike print alike: `rank 2 world 4 mesh (2, 2) names ('dp', 'tp')` on every rank
but one, whose line says `names ('tp', 'dp')` or `samples 40 batches 5` where the others say 56 and
7. When every rank timed out or the job hung and no rank is named, or gloo aborted the rank that
received a message of another size, the one rank whose start-up words (its own rank number aside)
differ from all the others', which agree, went its own way; rank 0 counting one more of something
(a remainder's share) did not."""

from __future__ import annotations

import re
from dataclasses import replace

from logtriage.analysis.findings import mask_numbers
from logtriage.analysis.last_lines import pieces_before
from logtriage.analysis.odd_dtype import SIZE_RULE
from logtriage.analysis.rank_evidence import odd_one_out
from logtriage.analysis.roots import RankFacts, RootCause
from logtriage.analysis.stopped import PDSH_HOST
from logtriage.catalog.rule import Category
from logtriage.demux.line_marks import OWN_RANK
from logtriage.demux.streams import StreamKey, StreamKind
from logtriage.scan_result import ScanResult, step_number

HEAD = 160          # lines of the input read for each rank's first line
# a rank's error or warning, or the agent's summary field, not how a rank started
_NOT_START = re.compile(r"Traceback|Error\b|Warning\b|\(local_rank: \d+\)")
_UNNAMED = (Category.COLLECTIVE_TIMEOUT, Category.HANG)
_WARNING = re.compile(r"^(?:\[?WARN(?:ING)?\b|.{0,60}\b(?:WARN(?:ING)?|[Ww]arning)\b[\]:])")


def odd_start_rank(scan: ScanResult, keys: list[StreamKey], root: RootCause, facts: RankFacts) -> RootCause:
    """A timeout or hang with no rank, or gloo's size abort (on the rank that received the odd
    message, not the one that sent it), moves to the one rank whose first line naming itself differs."""
    unnamed = root.rank is None and root.rule.category in _UNNAMED
    if unnamed and len(facts.known) >= 2 and scan.sources:
        first = root.finding
        warned = lone_warning(scan, keys, first.line if first is not None and first.source == 0 else HEAD + 1)
        if warned is not None and warned[0] in facts.known:
            rank, line = warned
            return replace(root, rank=rank, ranks=(rank,), confidence=min(root.confidence, 0.35), reasons=root.reasons + (
                f"rank {rank} alone warned as it started (`{line[:100]}`): it went its own way, and the others "
                "waited on it",))
    if len(facts.known) >= 3 and set(root.ranks) >= facts.known and scan.sources:
        said = _start_lines(scan, keys)     # the same error on every rank: one of them may have started with nothing
        rank = _zero_share({who: lines[0] for who, lines in said.items()}) if set(said) == set(facts.known) else None
        if rank is not None and rank != root.rank:
            shared = tuple(r.split(":")[0] if r.startswith("the same error on") else r for r in root.reasons)
            return replace(root, rank=rank, confidence=min(root.confidence, 0.4), reasons=shared + (
                f"rank {rank}'s start-up line (`{said[rank][0][:100]}`) counts 0 where every other rank's counts "
                "some: it started with nothing, and the error every rank then met is its",))
    if not (unnamed or root.rule.id == SIZE_RULE) or len(facts.known) < 3 or not scan.sources:
        return root
    said = _start_lines(scan, keys)
    if set(said) != set(facts.known):
        return _last_line_out(scan, keys, root, facts) if root.rule.id == SIZE_RULE else root
    compared = {who: lines[0] for who, lines in said.items()}
    rank = odd_one_out(compared)
    if rank == 0 and _said_more_first(said):
        rank = None
    if rank is None and len(set(compared.values())) == 1 and root.rule.id == SIZE_RULE:
        # every rank's first line alike: the one rank that said more, or other, before its first step
        # (`rank 0: DEBUG_ACT_HIST=1, registered act_hist buffer`) set up a message of its own size
        compared = {who: "\n".join(lines[1:]) for who, lines in said.items()}
        rank = odd_one_out(compared)
    if rank is None or rank == root.rank or _remainder_share(compared, rank):
        return _last_line_out(scan, keys, root, facts) if root.rule.id == SIZE_RULE and rank is None else root
    other = said[next(r for r in said if r != rank)]
    line = next((t for t in said[rank] if t not in other), said[rank][0])
    return replace(root, rank=rank, ranks=(rank,), confidence=min(root.confidence, 0.35), reasons=root.reasons + (
        f"rank {rank}'s start-up line (`{line[:100]}`) differs from every other rank's, which agree: it was set up "
        "its own way, and the others waited on it",))


# lines after gloo's abort in which another rank's last plain line may still come (its output was buffered)
LATE_LINES = 40
# (what is no start-up line is no plain line either; nor an error's own words, a native abort, a frame)
_NOT_PLAIN = re.compile(_NOT_START.pattern + r"|error|terminate called|what\(\)|^\s|File \"|[Ss]ignal")


def _last_line_out(scan: ScanResult, keys: list[StreamKey], root: RootCause, facts: RankFacts) -> RootCause:
    """gloo's size abort, where the ranks started alike: the one rank whose last line of a kind every rank
    printed, before the abort (or before its own error, for a rank whose output came late), says another
    number than every other rank's (`rank 1 eval: 128 reals, 128 fakes, 10-dim features` where the others
    say 6-dim) sent the message of another size."""
    first = root.finding
    if first is None or first.source >= len(scan.sources):
        return root
    # each rank's last line of each shape (numbers masked), and where each shape was last said
    by_shape: dict[str, dict[int, str]] = {}
    said_at: dict[str, int] = {}
    stopped: set[int] = set()
    for number, _, rank, piece in pieces_before(scan, keys, first.source, first.line, LATE_LINES):
        text = piece.strip()
        if rank is None or rank in stopped or not text:
            continue
        if _NOT_PLAIN.search(text):
            if number >= first.line:
                stopped.add(rank)   # a rank's line printed after the abort counts until its own error begins
            continue
        shape = mask_numbers(text)
        by_shape.setdefault(shape, {})[rank] = text
        said_at[shape] = number
    # the latest line every rank said in which one rank's numbers alone differ (lines of per-rank values,
    # a loss, differ on every rank and say nothing)
    for shape in sorted(by_shape, key=said_at.__getitem__, reverse=True):
        last = by_shape[shape]
        rank = odd_line_out(last) if set(last) == set(facts.known) and "#" in shape else None
        if rank is not None:
            break
    else:
        return root
    if rank == root.rank:
        return root
    return replace(root, rank=rank, ranks=(rank,), confidence=min(root.confidence, 0.35), reasons=root.reasons + (
        f"rank {rank}'s last line of a kind every rank printed before the abort (`{last[rank][:100]}`) says another "
        "number than every other rank's same line: it sent the message of another size",))


def lone_warning(scan: ScanResult, keys: list[StreamKey], end: int) -> tuple[int, str] | None:
    """The one rank that printed a warning of its own in the input's first lines, before line `end` (the
    failure's: `WARNING rank 0: batch 14 is not a multiple of micro-batch 4; dropping the last 2 samples`),
    where no other rank warned at all."""
    warned: dict[int, str] = {}
    for _, key, rank, piece in pieces_before(scan, keys, 0, min(end, HEAD + 1)):
        text = PDSH_HOST.sub("", piece.strip())
        if key.kind is not StreamKind.LAUNCHER and rank is not None and _WARNING.search(text):
            warned.setdefault(rank, text)
    return next(iter(warned.items())) if len(warned) == 1 else None


def _start_lines(scan: ScanResult, keys: list[StreamKey]) -> dict[int, list[str]]:
    """Each rank's first line that names itself (the script's own words, no step, error or warning), then
    its other such lines before its first step line, in the input's first lines; its own number made `#`."""
    said: dict[int, list[str]] = {}
    stepped: set[int] = set()
    for _, key, rank, piece in pieces_before(scan, keys, 0, HEAD + 1):
        if key.kind is StreamKind.LAUNCHER:
            continue     # the agent's own lines (its summary's `rank      : 3 (local_rank: 3)`)
        for who, text in _own_lines(rank, PDSH_HOST.sub("", piece.strip())):
            if who is None or not OWN_RANK.match(text):   # a line that starts by naming its rank
                continue
            if step_number(text) is not None:
                stepped.add(who)
            elif not _NOT_START.search(text) and (who not in said or who not in stepped):
                said.setdefault(who, []).append(_own_index(who).sub("#/", OWN_RANK.sub("rank #", text)))
    return said


_NUMBER = re.compile(r"(\d+)")


def _said_more_first(said: dict[int, list[str]]) -> bool:
    """Rank 0's first line is one of its own (`rank 0 wrote 128 HR patches to /tmp/sr`), and then it said what
    every other rank said first (`rank # train 32 patches 24x24`): it prepared something for all of them before
    it started as they did, which is a program's rank-0 work, not a rank set up its own way."""
    first = {mask_numbers(lines[0]) for rank, lines in said.items() if rank != 0}
    return len(first) == 1 and next(iter(first)) in {mask_numbers(line) for line in said[0][1:]}


def _remainder_share(said: dict[int, str], rank: int) -> bool:
    """Rank 0's line differs from the others' only in counts one higher (`shard 52 samples` where
    they say 51): the first ranks take the remainder when a total does not divide by the world
    size, so rank 0 was set up as the split sets up every job of that size, not its own way."""
    other = next(text for r, text in said.items() if r != rank)
    numbers = _numbers_side_by_side(_NUMBER.split(said[rank]), _NUMBER.split(other))
    return rank == 0 and numbers is not None and all(a - b in (0, 1) for a, b in numbers)


def _zero_share(said: dict[int, str]) -> int | None:
    """The one rank whose start-up line counts 0 of something every other rank has some of (`samples 0` where
    the others say 40000 to 58000, their words otherwise alike): a client or a shard with no data. Linear in the
    ranks: each line is split once and every place read across all of them."""
    pieces = {rank: _NUMBER.split(text) for rank, text in said.items()}
    words = next(iter(pieces.values()))[0::2]
    if any(parts[0::2] != words for parts in pieces.values()):
        return None
    numbers = {rank: [int(n) for n in parts[1::2]] for rank, parts in pieces.items()}
    empty = set()
    for place in range(len(words) - 1):
        zeros = [rank for rank, values in numbers.items() if values[place] == 0]
        # (another rank's own number there is an index, `tp=2`, not a count)
        if len(zeros) == 1 and all(0 < values[place] != rank for rank, values in numbers.items() if rank != zeros[0]):
            empty.add(zeros[0])
    return next(iter(empty)) if len(empty) == 1 else None


def _numbers_side_by_side(mine: list[str], theirs: list[str]) -> list[tuple[int, int]] | None:
    """Two lines split at their numbers: the numbers pairwise where the words between are the same, else None."""
    if len(mine) != len(theirs) or mine[0::2] != theirs[0::2]:
        return None
    return [(int(a), int(b)) for a, b in zip(mine[1::2], theirs[1::2])]


def _own_index(rank: int) -> re.Pattern:
    """The rank's number again as an index of a count (`stage 2/4`, `proc 2/8`): its own, not a difference."""
    return re.compile(rf"(?<![\w.]){rank}/(?=\d)")


def _own_lines(rank: int | None, text: str) -> list[tuple[int | None, str]]:
    """A line as (rank, text) pieces: two ranks' start lines glued on one line (`... ('dp', 'tp')rank 3 world 4
    ...`) are two, each the rank its own `rank N` names; an unattributed line starting `rank N` is rank N's."""
    marks = list(OWN_RANK.finditer(text))
    if len(marks) < 2 or marks[0].start() != 0:
        if rank is None and marks and marks[0].start() == 0:
            return [(int(marks[0].group(1)), text)]   # a line no prefix gave a rank, that names its own
        return [(rank, text)]
    cuts = [m.start() for m in marks] + [len(text)]
    return [(int(m.group(1)), text[a:b].strip()) for m, a, b in zip(marks, cuts, cuts[1:])]


def odd_line_out(said: dict[int, str]) -> int | None:
    """The one rank whose line (`rank 3 step 3 surgery: wrote ready_4_3, waiting`) differs from every
    other rank's, where those all agree (`rank 0 ... wrote ready_3_0, waiting`): two ranks' lines agree
    where their words are the same and each number is the same or is each line's own rank. Three ranks
    at least, so that the others' agreement means something. Linear in the ranks: lines alike once each
    rank's own number is masked agree; the rest are compared with one of the largest such group."""
    if len(said) < 3:
        return None
    pieces = {rank: _NUMBER.split(text) for rank, text in said.items()}
    groups: dict[tuple, list[int]] = {}
    for rank, parts in pieces.items():
        masked = tuple("#" if i % 2 and part == str(rank) else part for i, part in enumerate(parts))
        groups.setdefault(masked, []).append(rank)
    model = max(groups.values(), key=len)[0]
    odd = [rank for rank in said if not _agree(rank, pieces[rank], model, pieces[model])]
    return odd[0] if len(odd) == 1 else None


def _agree(rank: int, mine: list[str], other: int, theirs: list[str]) -> bool:
    numbers = _numbers_side_by_side(mine, theirs)
    return numbers is not None and all(a == b or (a == rank and b == other) for a, b in numbers)
