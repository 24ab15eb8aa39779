"""What the runner needs from the catalog: grep's pattern file, the rule count, extra rules.

`grep -cEf PATTERNS` gets the catalog's own patterns from `triage catalog grep-patterns`; when
that command is missing or fails, a built-in list of 35 typical error patterns stands in (the
issue's measurement used one like it) and the runner says so.

The 10x-rules case adds synthetic user rules in the schema of docs/catalog.md: distinct,
literal-anchored patterns with captures, shaped like real ones, that never match a generated log.
"""

from __future__ import annotations

import json
import random
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

FALLBACK_PATTERNS = (
    r"Traceback \(most recent call last\):",
    r"CUDA out of memory\. Tried to allocate",
    r"OutOfMemoryError",
    r"Watchdog caught collective operation timeout",
    r"failure detected by watchdog at work sequence id",
    r"Heartbeat monitor timed out",
    r"NCCL error in: ",
    r"terminate called after throwing an instance of",
    r"terminate called without an active exception",
    r"Fatal Python error: ",
    r"Sending process [0-9]+ closing signal SIG[A-Z]+",
    r"failed \(exitcode: -?[0-9]+\) local_rank: [0-9]+",
    r"ChildFailedError",
    r"exitcode +: -?[0-9]+ \(pid: [0-9]+\)",
    r"Signal [0-9]+ \(SIG[A-Z]+\) received by PID",
    r"Connection closed by peer",
    r"Connection reset by peer",
    r"Timed out waiting [0-9]+ms for (recv|send) operation to complete",
    r"Gloo connectFullMesh failed",
    r"Detected mismatch between collectives on ranks",
    r"Expected to have finished reduction in the prior iteration",
    r"returned nan values in its [0-9]+th output",
    r"is non-finite, so it cannot be clipped",
    r"DefaultCPUAllocator: can't allocate memory",
    r"Error\(s\) in loading state_dict for",
    r"Weights only load failed",
    r"EADDRINUSE",
    r"The connection to the C10d store has failed",
    r"Torch not compiled with CUDA enabled",
    r"Distributed package doesn't have NCCL built in",
    r"SignalException: Process [0-9]+ got signal: [0-9]+",
    r"ProcessRaisedException|ProcessExitedException",
    r"CUDA error: an illegal memory access was encountered",
    r"device-side assert triggered",
    r"^[A-Za-z_.]*(Error|Exception): ",
)


@dataclass(frozen=True)
class GrepPatterns:
    path: Path
    count: int
    from_catalog: bool
    warning: str


def grep_patterns(triage: Sequence[str], cwd: Path, out: Path) -> GrepPatterns:
    """Write grep's pattern file; prefer `triage catalog grep-patterns`."""
    try:
        proc = subprocess.run([*triage, "catalog", "grep-patterns"], cwd=cwd, capture_output=True,
                              text=True, timeout=120)
        lines = [line for line in proc.stdout.splitlines() if line.strip()]
        if proc.returncode == 0 and lines:
            out.write_text("\n".join(lines) + "\n", encoding="utf-8")
            return GrepPatterns(out, len(lines), True, "")
        last = proc.stderr.strip().splitlines()[-1:]
        why = f"exit {proc.returncode}: {last[0] if last else 'no patterns printed'}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = str(exc)
    out.write_text("\n".join(FALLBACK_PATTERNS) + "\n", encoding="utf-8")
    return GrepPatterns(out, len(FALLBACK_PATTERNS), False,
                        f"`triage catalog grep-patterns` unavailable ({why}); grep uses the runner's "
                        f"built-in list of {len(FALLBACK_PATTERNS)} patterns")


def catalog_rule_count(triage: Sequence[str], cwd: Path) -> int:
    """Rules in the default catalog, from `triage catalog list --format json` or the files."""
    try:
        proc = subprocess.run([*triage, "catalog", "list", "--format", "json"], cwd=cwd,
                              capture_output=True, text=True, timeout=120)
        if proc.returncode == 0:
            return len(json.loads(proc.stdout))
    except (OSError, subprocess.TimeoutExpired, ValueError):
        pass
    return len(list((cwd / "patterns").rglob("*.toml")))


_WORDS = ("spindle", "ledger", "quorum", "lattice", "beacon", "conduit", "harbor", "prism", "vortex",
          "cinder", "meridian", "tundra", "basalt", "cobalt", "falcon", "juniper", "kestrel", "onyx")


def _rule(n: int, rng: random.Random) -> tuple[str, str]:
    """One synthetic rule (TOML text) and its id. Patterns never match generated logs: each
    requires the literal `zq-bench-<n>` token, and distinct words keep them from merging."""
    a, b = rng.sample(_WORDS, 2)
    tag = f"zq-bench-{n:05d}"
    shapes = [
        (rf"{a.capitalize()}{b.capitalize()}\.cpp:(?P<line>\d+)\] {tag} (?P<op>[a-z_]+) stalled after (?P<ms>\d+)ms",
         f"[E1130 00:00:01.000000000 {a.capitalize()}{b.capitalize()}.cpp:12] {tag} allreduce stalled after 500ms"),
        (rf"^(?P<exception_type>[A-Za-z_.]*{a.capitalize()}Error): {tag} {b} (?P<detail>.+)$",
         f"{a.capitalize()}Error: {tag} {b} lost its peer"),
        (rf"\[{tag}\] (?P<peer>[\w.-]+):(?P<port>\d+) {a} {b} refused",
         f"[{tag}] node-007:29500 {a} {b} refused"),
    ]
    pattern, example = shapes[n % len(shapes)]
    rule_id = f"bench.synthetic_{n:05d}"
    text = "\n".join([
        f'id = "{rule_id}"',
        f'title = "Synthetic benchmark rule {n}: {a} {b}"',
        'category = "unknown"',
        'layer = "report"',
        'role = "context"',
        'severity = "info"',
        "priority = 1",
        'status = "experimental"',
        f"patterns = ['{pattern}']",
        f'explanation = """A generated rule that exists only to measure the cost of a larger catalog."""',
        'fix = """None: it never matches a real log."""',
        'misdiagnosis = """None."""',
        'references = ["benchmarks/harness/catalog_inputs.py"]',
        "",
        "[[examples]]",
        f"line = '{example}'",
        'source = "synthetic"',
        "",
    ])
    return text, rule_id


def write_synthetic_rules(directory: Path, count: int, seed: int = 1) -> int:
    """Fill `directory` with `count` rule files (replacing earlier ones); returns the count."""
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.toml"):
        old.unlink()
    rng = random.Random(seed)
    for n in range(count):
        text, rule_id = _rule(n, rng)
        (directory / f"{rule_id}.toml").write_text(text, encoding="utf-8")
    return count
