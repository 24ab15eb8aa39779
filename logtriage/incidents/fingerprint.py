"""Grouping fingerprints, in the manner of Sentry's: the same failure on another run, rank, host
or day gets the same key; another failure gets another.

    fingerprint("python.exception", "python_exception", "KeyError: 'target'")
    -> Fingerprint(version=1, hash="…", basis="python.exception|python_exception|KeyError: 'target'")

Components (version 1): the root-cause rule id, its category, and the root-cause line with its
volatile parts masked: log prefixes (glog, rank, timestamp) removed; timestamps, URLs, paths,
IP addresses, host names, hex ids and addresses, long random tokens, sizes (an OOM of 132 MiB
and one of 14 GiB are one failure), and every number but an exit code, signal or errno replaced
by a placeholder; then only its first two sentences are kept. The version is part of the hashed text and of the
stored key, so a new algorithm never lands on an old key by accident: an upgrade adds a version
here and keeps the old ones (see docs/incidents.md, "Changing the algorithm").
"""

from __future__ import annotations

import hashlib
import re
from typing import Callable

from logtriage.incidents.models import Fingerprint

MAX_BASIS = 300
_SENTENCE_END = re.compile(r"[.!?](?=\s)")

_PREFIXES = (
    re.compile(r"^\s*\[(?:rank|default)?\d+\]:\s*"),                              # [rank2]:, [default0]:
    re.compile(r"^\s*\[\d+,\d+\]<std(?:out|err)>:\s*"),                            # mpirun --tag-output
    re.compile(r"^\s*[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+\s+\S+:\d+\]\s*"),       # glog (torch C++/elastic)
    re.compile(r"^\s*\[[IWEF]\d{0,4}(?: \d\d:\d\d:\d\d\.\d+)?\s*[\w./-]+:\d+\]\s*"),  # [E ProcessGroupNCCL.cpp:457]
    re.compile(r"^\s*\[?\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?\]?\s*"),     # [2023-07-10 04:26:35,999]
    re.compile(r"^\s*(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):[\w.]+:\s*"),            # python logging
    re.compile(r"^\s*\S+:\d+:\d+ \[\d+\]\s*"),                                       # NCCL host:pid:tid [dev]
)

_MASKS: tuple[tuple[re.Pattern, str | Callable[[re.Match], str]], ...] = (
    (re.compile(r"\b[a-z][a-z0-9+.-]*://\S+", re.I), "<url>"),
    (re.compile(r"\d{4}-\d\d-\d\d(?:[T _]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?)?"), "<time>"),
    (re.compile(r"\b\d\d:\d\d:\d\d(?:\.\d+)?\b"), "<time>"),
    (re.compile(r"(?i)\b(?:host(?:name)?|node|master_addr)\s*[:=]\s*[\w.-]+"), "host=<host>"),
    (re.compile(r"(?:[A-Za-z]:)?(?:[/\\][^\s/\\:'\"(),\[\]<>]+){2,}[/\\]?"), "<path>"),
    (re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+|<\d+>)?"), "<ip>"),
    (re.compile(r"\[?\b(?:[0-9a-f]{1,4}:){2,7}[0-9a-f]{0,4}\]?(?::\d+)?", re.I), "<ip>"),
    (re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", re.I), "<uuid>"),
    (re.compile(r"\bON \S+ CANCELLED"), "ON <host> CANCELLED"),
    (re.compile(r"\b\d+(?:\.\d+)? ?(?:[KMGTP]i?B|bytes|B)\b"), "<size>"),      # 709.69 MiB, 3.00 GiB
    (re.compile(r"\b(?=[\w+/=-]*\d)(?=[\w+/=-]*[A-Za-z])[\w+/=-]{20,}"), "<id>"),
    # Exit codes, signals and errnos are the diagnosis: kept. Other numbers, and short hex words
    # with a digit (PCI bus ids, `c10d`), become <n>; addresses and long hex ids <hex>.
    (re.compile(r"(?i)(?P<keep>(?:exit ?code|exitcode|errno|error code|return code|signal)\W{0,3}-?\d+)"
                r"|(?P<hex>\b0x[0-9a-f]+\b|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{8,}\b)"
                r"|(?P<num>\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{1,7}\b|\d+(?:\.\d+)?)"),
     lambda m: m.group("keep") or ("<hex>" if m.group("hex") else "<n>")),
    (re.compile(r"\s+"), " "),
)


def strip_prefixes(text: str) -> str:
    """The first line of `text` without its log prefixes (rank, glog, timestamp, logger, NCCL)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    changed = True
    while changed:                      # prefixes nest: "[rank2]: E1130 ... api.py:1002] ..."
        changed = False
        for prefix in _PREFIXES:
            stripped = prefix.sub("", line, count=1)
            if stripped != line:
                line, changed = stripped, True
    return line


def _basis_v1(rule_id: str, category: str, text: str) -> str:
    line = strip_prefixes(text)
    for pattern, replacement in _MASKS:
        line = pattern.sub(replacement, line)
    # Two sentences name the failure; what follows is circumstance (the OOM's "Process 2521 has
    # 3 GiB in use", the allocator hints) that varies between runs of the same failure.
    ends = [m.end() for m in _SENTENCE_END.finditer(line)]
    if len(ends) >= 2:
        line = line[:ends[1]]
    return f"{rule_id}|{category}|{line.strip()[:MAX_BASIS]}"


# version -> basis function. Never change a released version's function: add a new version.
ALGORITHMS: dict[int, Callable[[str, str, str], str]] = {1: _basis_v1}
CURRENT_VERSION = 1


def fingerprint(rule_id: str, category: str, text: str, version: int = CURRENT_VERSION) -> Fingerprint:
    basis = ALGORITHMS[version](rule_id, category, text)
    digest = hashlib.sha256(f"v{version}\x1f{basis}".encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return Fingerprint(version, digest, basis)


def all_fingerprints(rule_id: str, category: str, text: str) -> tuple[Fingerprint, ...]:
    """The current version's fingerprint first, then every older version's: an incident created
    by an older logtriage is still found, and the new key is added to it (no silent regrouping)."""
    versions = sorted(ALGORITHMS, reverse=True)
    current = [CURRENT_VERSION] + [v for v in versions if v != CURRENT_VERSION]
    return tuple(fingerprint(rule_id, category, text, v) for v in current)
