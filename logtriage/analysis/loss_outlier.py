"""A non-finite loss that every rank (or the wrong one) reports can start in one rank's data: its
progress lines show its loss leaving the others' by orders of magnitude a step or more before any
rank raised (`rank 2 step 3 loss 1848.8` where the others print 1.4), and the all-reduce then
spread the blow-up to every rank. That rank's data or settings started it. So did the one rank
whose own lines print a value as inf or nan (`rank 3 update 1 rollout ... reward inf`) under a name
every other rank prints finite values for, when several ranks raised the same numerical error. A non-finite
loss every rank printed at one step is the all-reduced loss and names no rank: the one rank whose own check
then raised is where it started."""

from __future__ import annotations

import math
import re
from dataclasses import replace

from logtriage.analysis.findings import Finding
from logtriage.analysis.last_lines import pieces_before
from logtriage.analysis.roots import RootCause
from logtriage.catalog.rule import Category, Role
from logtriage.demux.streams import StreamKey
from logtriage.scan_result import ScanResult, step_number

# a progress line's loss value: `loss 1.38`, `loss=1848.8191`, `loss: nan`
_VALUE = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf)"   # a printed number, or nan/inf
_LOSS = re.compile(r"\bloss\b\s*[=:]?\s*" + _VALUE + r"\b", re.IGNORECASE)
APART = 100.0        # a loss this many times the others' largest at the same step has left them
AGREE = 10.0         # the others' losses at that step lie within this factor of each other
MIN_OTHERS = 2


def loss_outlier_rank(scan: ScanResult, keys: list[StreamKey], root: RootCause) -> RootCause:
    f = root.finding
    if root.rule.category is not Category.NUMERICAL or f is None or f.source >= len(scan.sources):
        return root
    losses = _losses_by_step(scan, keys, f.source, f.line + 1)
    for step in sorted(losses):
        odd = _left_the_others(losses[step])
        if odd is None:
            continue
        if odd == root.rank:
            return root
        rank, value = odd, losses[step][odd]
        others = [v for r, v in losses[step].items() if r != rank]
        return replace(root, rank=rank, ranks=(rank,), confidence=min(root.confidence, 0.5), reasons=(
            *root.reasons, f"rank {rank}'s loss at step {step} was {value:g} where every other rank's was at most "
            f"{max(others):g}: its loss left the others' first, and the all-reduce spread the blow-up from there "
            "(its data, its batch, its settings)"))
    return _nonfinite_named_value(scan, keys, root)


# a value a rank prints by name: `reward inf`, `ret=-1.2`, `grad_norm: nan`
_NAMED_VALUE = re.compile(r"\b([A-Za-z_][\w.]*)\s*[=:]?\s*" + _VALUE + r"(?![\w.])", re.IGNORECASE)
# a rank's own count of the non-finite values it found (`384 non-finite input values`, `0 NaN pixels`)
_NONFINITE_COUNT = re.compile(r"\b(\d+) (?:non-?finite|nan|inf|infinite)\b", re.IGNORECASE)
_NOT_PROGRESS = re.compile(r"Error\b|Exception\b|Traceback|Warning\b")
AFTER = 80   # lines after the error read too: a rank's buffered stdout comes after its traceback (`--tee`)


def _nonfinite_named_value(scan: ScanResult, keys: list[StreamKey], root: RootCause) -> RootCause:
    """Several ranks raised the same numerical error; the one rank that printed a named value as inf or
    nan, where every other rank (at least MIN_OTHERS) printed that name with finite values only, started it."""
    f = root.finding
    if len(root.ranks) < MIN_OTHERS:
        return root
    finite: dict[str, dict[int, bool]] = {}      # name -> rank -> all its values finite
    counted: dict[int, int] = {}                 # rank -> the most non-finite values it counted
    for _, _, rank, piece in pieces_before(scan, keys, f.source, f.line + AFTER):
        if rank is None or _NOT_PROGRESS.search(piece):
            continue
        for name, value in _NAMED_VALUE.findall(piece):
            ok = math.isfinite(float(value))
            seen = finite.setdefault(name.lower(), {})
            seen[rank] = seen.get(rank, True) and ok
        for number in _NONFINITE_COUNT.findall(piece):
            counted[rank] = max(counted.get(rank, 0), int(number))
    lone = {name: next(r for r, ok in by_rank.items() if not ok) for name, by_rank in finite.items()
            if sum(not ok for ok in by_rank.values()) == 1 and sum(by_rank.values()) >= MIN_OTHERS}
    if len(set(lone.values())) != 1:
        return _lone_nonfinite_count(root, counted)
    rank = next(iter(lone.values()))
    if rank == root.rank:
        return root
    names = sorted(lone)
    return replace(root, rank=rank, ranks=(rank,), confidence=min(root.confidence, 0.5), reasons=(
        *root.reasons, f"rank {rank} alone printed its {', '.join(names[:3])} as inf or nan, where every other rank "
        "printed finite values: the non-finite value started on it, and the all-reduce spread it"))


def _lone_nonfinite_count(root: RootCause, counted: dict[int, int]) -> RootCause:
    """Several ranks raised the same numerical error; each printed its own count of the non-finite values it
    found (`counted`: rank -> its largest count), and exactly one rank counted any (`rank 1: ...; 384 non-finite
    input values` where every other rank, MIN_OTHERS or more, says `0 non-finite input values`): its data held
    them, and it started there."""
    found = [r for r, n in counted.items() if n > 0]
    if len(found) != 1 or len(counted) - 1 < MIN_OTHERS or found[0] == root.rank:
        return root
    rank = found[0]
    return replace(root, rank=rank, ranks=(rank,), confidence=min(root.confidence, 0.5), reasons=(
        *root.reasons, f"rank {rank} alone counted non-finite values in what it read ({counted[rank]}), where every "
        "other rank counted none: the non-finite values started on it, and the all-reduce spread them"))


def _losses_by_step(scan: ScanResult, keys: list[StreamKey], source: int, end: int) -> dict[int, dict[int, float]]:
    """step -> rank -> the rank's first loss printed at that step, from the progress lines before line `end`."""
    losses: dict[int, dict[int, float]] = {}
    for _, _, rank, piece in pieces_before(scan, keys, source, end):
        step = step_number(piece) if rank is not None else None
        m = _LOSS.search(piece) if step is not None else None
        if m is not None:
            losses.setdefault(step, {}).setdefault(rank, float(m.group(1)))
    return losses


def _left_the_others(at_step: dict[int, float]) -> int | None:
    """The one rank whose loss at a step is non-finite or APART times the others', which agree."""
    if len(at_step) < MIN_OTHERS + 1:
        return None
    wild = [r for r, v in at_step.items() if not math.isfinite(v)]
    if not wild:
        ranked = sorted(at_step, key=lambda r: abs(at_step[r]))
        top, rest = ranked[-1], [abs(at_step[r]) for r in ranked[:-1]]
        if abs(at_step[top]) > APART * max(max(rest), 1e-3):
            wild = [top]
    if len(wild) != 1:
        return None
    rest = [abs(v) for r, v in at_step.items() if r != wild[0]]
    if not all(math.isfinite(v) for v in rest) or max(rest) > AGREE * max(min(rest), 1e-3):
        return None
    return wild[0]


def shared_nan_then_one_check(scan: ScanResult, keys: list[StreamKey], root: RootCause,
                              findings: list[Finding]) -> RootCause:
    """A printed non-finite loss (no exception) that every rank printing that step printed alike (MIN_OTHERS + 1
    or more) is the reduced loss, the same on all: it names no rank. Where exactly one rank's own check then raised
    a numerical error (`FloatingPointError: non-finite velocity features on rank 3 at step 3`), that check, on that
    rank, is the root."""
    f = root.finding
    if root.rule.category is not Category.NUMERICAL or f is None or f.exception_type or f.source >= len(scan.sources):
        return root
    step = step_number(f.text)
    checks = [g for g in findings if g.category is Category.NUMERICAL and g.role is Role.ROOT_CANDIDATE
              and g.exception_type and g.rank is not None and g.source == f.source and g.seq > f.seq]
    if step is None or len({g.rank for g in checks}) != 1:
        return root
    at_step = _losses_by_step(scan, keys, f.source, f.line + AFTER).get(step, {})
    if len(at_step) < MIN_OTHERS + 1 or any(math.isfinite(v) for v in at_step.values()):
        return root
    check = min(checks, key=lambda g: g.seq)
    return RootCause(check.rule, check, check.rank, (check.rank,), min(root.confidence, 0.6), (
        *root.reasons, f"every rank printed a non-finite loss at step {step} alike (the reduced loss, the same on all: "
        f"it names no rank); rank {check.rank} alone then raised its own check (line {check.line}): it started there"))
