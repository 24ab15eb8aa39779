"""Find the lines any rule could match, or that the demuxer treats specially, in one RE2 scan
of a whole chunk.

Each catalog pattern contributes the literal strings one of which must occur in any match
(found by walking the pattern's syntax tree), or the pattern itself when its literals are too
short to be selective. Structural literals cover every line shape the demuxer handles beyond
prefixes and markers (tracebacks, launcher and scheduler lines, probes, banners, error records).
A line without any of them provably gets no finding and no special treatment."""

from __future__ import annotations

import re
import re._constants as C
import re._parser as P

import numpy as np
import re2

from logtriage.catalog.compiled import CompiledRule

MIN_ATOM = 5
# Words on nearly every line of a training log: a literal that is only one of these selects
# nothing, so its pattern scans as a whole instead.
COMMON_WORDS = frozenset({"loss", "step", "rank", "epoch", "iter", "info", "warn", "debug", "train", "time", "node"})

# Line shapes the demuxer or scan treat specially (see demux/assigner.py, demux/launcher.py,
# demux/blocks.py, scan.py); the kernel covers those decided by a line's first bytes.
STRUCTURAL = (
    "Traceback (most recent call last)", "Error: ", "Exception: ", "Warning: ", "Fatal Python error",
    "terminate called", "ChildFailedError", "Root Cause", "Failures:", "NO_OTHER_FAILURES", "FutureWarning",
    "srun: ", "slurmstepd", "sbatch: ", "salloc: ", "mpirun", "prterun", "pdsh@", "Primary job",
    "Per user-direction", "The following values were not passed", "Setting OMP_NUM_THREADS",
    "[launch.py:", "[runner.py:", "[launcher_helper.py:", "[multinode_runner.py:",
    ":torch.distributed.", ":__main__:", ":torch.multiprocessing", "_JSON=", "-- Process",
    "torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher",   # the 2.x logger
    "ERROR", "CRITICAL", "FATAL", "Exception", "exception", "atexit._run_exitfuncs", "orld", "ORLD", "nproc", "gloo", "+cpu",
)


def required_atoms(pattern: str) -> tuple[set[str], bool] | None:
    """(literals one of which every match contains, case-insensitive?) or None."""
    try:
        tree = P.parse(pattern)
    except Exception:  # noqa: BLE001 - RE2-only syntax: no atoms, the pattern scans itself
        return None
    atoms = _sequence(list(tree))
    if not atoms:
        return None
    return atoms, bool(tree.state.flags & C.SRE_FLAG_IGNORECASE)


def _sequence(items) -> set[str] | None:
    options, run = [], []

    def flush():
        if len(run) >= 3:
            options.append({"".join(run)})
        run.clear()

    for op, av in items:
        if op is C.LITERAL:
            run.append(chr(av))
            continue
        flush()
        got = _node(op, av)
        if got:
            options.append(got)
    flush()
    if not options:
        return None
    return max(options, key=lambda s: (min(len(a) for a in s), -len(s)))


def _node(op, av) -> set[str] | None:
    if op is C.SUBPATTERN:
        return _sequence(list(av[3]))
    if op is C.BRANCH:
        out: set[str] = set()
        for branch in av[1]:
            got = _sequence(list(branch))
            if not got:
                return None
            out |= got
        return out
    if op in (C.MAX_REPEAT, C.MIN_REPEAT, C.POSSESSIVE_REPEAT):
        low, _, sub = av
        return _sequence(list(sub)) if low >= 1 else None
    return None


_GROUP = re.compile(r"\(\?P<\w+>")


class Prefilter:
    """The scan over a chunk: Hyperscan where it is installed (x86-64 Linux; several times faster
    on many literals), else one RE2 alternation. Both report every line a rule could match."""

    def __init__(self, rules: list[CompiledRule]):
        literals: set[str] = set(STRUCTURAL)
        folded: set[str] = set()
        whole: list[str] = []
        for compiled in rules:
            for pattern in compiled.rule.patterns:
                found = required_atoms(pattern)
                if found and min(len(a) for a in found[0]) >= MIN_ATOM and \
                        not any(a.strip(" :=|[]()").lower() in COMMON_WORDS for a in found[0]):
                    (folded if found[1] else literals).update(found[0])
                else:
                    bare = _GROUP.sub("(?:", pattern)
                    whole.append(bare[1:] if bare.startswith("^") else bare)
        parts = [re2.escape(a) for a in sorted(literals)]
        if folded:
            parts.append("(?i:" + "|".join(re2.escape(a) for a in sorted(folded)) + ")")
        parts += [f"(?:{p})" for p in whole]
        options = re2.Options()
        options.max_mem = 256 << 20
        self.regex = re2.compile("(?m)" + "|".join(parts), options)
        self.literal_count = len(literals) + len(folded)
        self.whole_count = len(whole)
        self.hyperscan = _hyperscan_database(sorted(literals), sorted(folded), whole)

    def candidate_lines(self, buf: bytes, starts: np.ndarray, offset: int = 0, size: int | None = None) -> np.ndarray:
        """Indices (into `starts`, relative to `offset`) of the lines of buf[offset:offset + size]
        holding a match."""
        end = len(buf) if size is None else offset + size
        if self.hyperscan is not None:
            return self._hyperscan_lines(buf if (offset, end) == (0, len(buf)) else memoryview(buf)[offset:end], starts)
        found = []
        search = self.regex.search
        pos = offset
        while pos < end:
            m = search(buf, pos, end)
            if m is None:
                break
            at = m.start()
            found.append(at - offset)
            nl = buf.find(b"\n", at, end)
            pos = end if nl < 0 else nl + 1
        if not found:
            return np.empty(0, dtype=np.int64)
        return np.searchsorted(starts, np.asarray(found, dtype=np.int64), side="right") - 1

    def _hyperscan_lines(self, buf, starts: np.ndarray) -> np.ndarray:
        """Hyperscan reports the end of every match, overlapping ones included, so every match a
        rule could make inside one line ends inside that line and marks it."""
        ends: list[int] = []
        self.hyperscan.scan(buf, match_event_handler=lambda _id, _start, end, _flags, _ctx: ends.append(end - 1))
        if not ends:
            return np.empty(0, dtype=np.int64)
        return np.unique(np.searchsorted(starts, np.asarray(ends, dtype=np.int64), side="right") - 1)


_BUILT: dict[tuple, Prefilter] = {}


def prefilter_for(rules: list[CompiledRule]) -> Prefilter:
    """The prefilter of a rule set, built once per process: Hyperscan's compile of some 1,300
    expressions takes a quarter of a second, which every small log would otherwise pay."""
    key = tuple((c.rule.id, tuple(c.rule.patterns)) for c in rules)
    found = _BUILT.get(key)
    if found is None:
        if len(_BUILT) >= 4:   # user rule directories make other sets; keep a few
            _BUILT.clear()
        found = _BUILT[key] = Prefilter(rules)
    return found


def _hyperscan_database(literals: list[str], folded: list[str], whole: list[str]):
    """A Hyperscan database of the same prefilter, or None (not installed, or a pattern it
    cannot take: the RE2 scan is used then)."""
    try:
        import hyperscan
    except ImportError:
        return None
    expressions, flags = [], []
    multiline = hyperscan.HS_FLAG_MULTILINE
    for literal in literals:
        expressions.append(re.escape(literal).encode())
        flags.append(multiline)
    for literal in folded:
        expressions.append(re.escape(literal).encode())
        flags.append(multiline | hyperscan.HS_FLAG_CASELESS)
    for pattern in whole:
        caseless = pattern.startswith("(?i)")
        expressions.append((pattern[4:] if caseless else pattern).encode())
        flags.append(multiline | (hyperscan.HS_FLAG_CASELESS if caseless else 0))
    try:
        database = hyperscan.Database()
        database.compile(expressions=expressions, ids=list(range(len(expressions))), elements=len(expressions),
                         flags=flags)
    except Exception:  # noqa: BLE001 - any pattern Hyperscan rejects: fall back to RE2
        return None
    return database
