"""What to generate (GenSpec) and what was injected (Expectation): frozen values, validated."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from logtriage.errors import UsageError


class Style(str, Enum):
    """How worker output reaches the console (FORMATS.md §2)."""

    PLAIN = "plain"  # default torchrun: shared fds, `[rankN]: ` only on tracebacks and C++ logs
    TEE = "tee"      # torchrun --tee 3: every worker line gets `[default<local_rank>]:`
    SRUN = "srun"    # `srun --label torchrun ...`: every line gets `<node>: ` (one task per node)


class FailureKind(str, Enum):
    NONE = "none"            # healthy run, exit 0
    OOM = "oom"              # torch.OutOfMemoryError on one rank
    EXCEPTION = "exception"  # a plain Python exception on one rank
    SIGKILL = "sigkill"      # one rank killed (-9), prints nothing
    TIMEOUT = "timeout"      # one rank hangs; the others hit the NCCL watchdog


# kind -> (verdict, category, rule id): the catalog's public names (docs/catalog.md).
EXPECTED_ROOT: dict[FailureKind, tuple[str, str, str]] = {
    FailureKind.NONE: ("ok", "", ""),
    FailureKind.OOM: ("failed", "gpu_oom", "cuda.oom"),
    FailureKind.EXCEPTION: ("failed", "python_exception", "python.exception"),
    FailureKind.SIGKILL: ("failed", "crash_signal", "signal.sigkill"),
    # A hung rank prints nothing and has no watchdog of its own: the others' watchdog timeouts are
    # the failure, and the desync report they append names the hung rank (a required finding).
    FailureKind.TIMEOUT: ("failed", "collective_timeout", "nccl.watchdog_timeout"),
}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)[bB]?\s*$")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


class SpecError(UsageError):
    """A generator argument is out of range or malformed."""


def parse_size(text: str) -> int:
    """'100M' -> 100_000_000 bytes (decimal units, like the issue's '1 GB')."""
    m = _SIZE.match(text)
    if not m:
        raise SpecError(f"bad size {text!r}: use a number with an optional k, M or G suffix")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 10_000:
        raise SpecError(f"size {text!r} is too small: at least 10k")
    return value


def format_size(size: int) -> str:
    for unit, factor in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


@dataclass(frozen=True)
class GenSpec:
    ranks: int
    size: int                      # target bytes; the log ends within a few kB of it
    seed: int = 1
    failure: FailureKind = FailureKind.OOM
    fail_rank: int | None = None   # None: drawn from the seed
    fail_at: float = 0.97          # where the failure sits, as a fraction of the size
    style: Style = Style.PLAIN
    ranks_per_node: int = 8
    banner: bool = True            # NGC container banner at the top of each node's output

    def __post_init__(self) -> None:
        if not 1 <= self.ranks <= 100_000:
            raise SpecError(f"--ranks {self.ranks}: must be between 1 and 100000")
        if self.ranks_per_node < 1:
            raise SpecError("--ranks-per-node must be at least 1")
        if self.fail_rank is not None and not 0 <= self.fail_rank < self.ranks:
            raise SpecError(f"--fail-rank {self.fail_rank}: must be in [0, {self.ranks})")
        if not 0.0 < self.fail_at <= 1.0:
            raise SpecError(f"--fail-at {self.fail_at}: must be in (0, 1]")
        if self.failure is not FailureKind.NONE and self.ranks < 2:
            raise SpecError("a failure with a cascade needs at least 2 ranks")

    @property
    def nodes(self) -> int:
        return -(-self.ranks // self.ranks_per_node)

    def args_line(self, size_label: str | None = None) -> str:
        """The generator arguments that reproduce this log byte for byte (`size_label` replaces
        the size, e.g. with a placeholder)."""
        size = size_label if size_label is not None else format_size(self.size)
        parts = [f"--ranks {self.ranks}", f"--size {size}", f"--seed {self.seed}",
                 f"--failure {self.failure.value}"]
        if self.fail_rank is not None:
            parts.append(f"--fail-rank {self.fail_rank}")
        parts += [f"--fail-at {self.fail_at:g}", f"--style {self.style.value}"]
        if self.ranks_per_node != 8:
            parts.append(f"--ranks-per-node {self.ranks_per_node}")
        if not self.banner:
            parts.append("--no-banner")
        return " ".join(parts)


@dataclass(frozen=True)
class Expectation:
    """What triage must say about the generated log; written as the *.expect.toml sidecar."""

    verdict: str
    category: str
    rule: str
    rank: int | None
    line: int                     # 1-based line of the root-cause evidence (0 for a healthy run)
    line_text: str                # that line, for humans reading the sidecar
    exception_type: str = ""
    required_findings: tuple[str, ...] = ()
    note: str = ""
    lines_total: int = 0
    bytes_total: int = 0
