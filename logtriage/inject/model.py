"""Values of the fault-injection suite: scenarios, their variants and expected diagnoses.

A scenario is one small training script plus one injected fault. Its expectation is written
in terms of the run (``RankRef.FAULT`` = the rank the fault was injected on), so the same
declaration stays true when a user runs it with another ``--nproc`` or fault rank; the runner
resolves it into a ``ResolvedExpectation`` with concrete rank numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from logtriage.analysis.roots import Verdict
from logtriage.catalog.rule import Category


class Backend(str, Enum):
    GLOO = "gloo"
    NCCL = "nccl"


class Launcher(str, Enum):
    """How the workers are started; each gives the console a different shape (FORMATS §10)."""

    TORCHRUN = "torchrun"
    RUN_MODULE = "python -m torch.distributed.run"
    LAUNCH_MODULE = "python -m torch.distributed.launch"
    MP_SPAWN = "mp.spawn"
    MPIRUN = "mpirun --tag-output"   # Open MPI; each process maps OMPI_COMM_WORLD_* to RANK/WORLD_SIZE
    # labelled by the runner as these launchers label lines (fanout.py): two torchrun agents
    # (nodes) on this host, or one process per rank with Slurm's task variables
    SRUN_TASKS = "srun --label (a task per rank)"
    SRUN_NODES = "srun --label torchrun (a task per node)"
    PDSH_NODES = "pdsh torchrun (a host per node)"


class RankRef(str, Enum):
    """Which rank the diagnosis must name, relative to the run."""

    FAULT = "fault"      # the rank the fault was injected on
    LOWEST = "lowest"    # rank 0: the same error on every rank
    NONE = "none"        # no rank (launcher-level error) or the log cannot show it


class RankSet(str, Enum):
    NONE = "none"        # no `ranks` key in the expectation
    ALL = "all"          # every rank of the run


class CodeBug(str, Enum):
    """DDP-rule violations a scenario script contains on purpose (what `triage lint` must flag).

    Scripts without a code bug must lint clean: the fault is injected through the launcher,
    the environment or the data, not through a DDP-rule violation.
    """

    COLLECTIVE_IN_RANK_BRANCH = "collective_in_rank_branch"
    SAVE_WITHOUT_BARRIER = "save_without_barrier"


@dataclass(frozen=True)
class Expectation:
    """What `triage` must say about the captured log (written as ``<name>.expect.toml``)."""

    verdict: Verdict
    category: str = ""
    rule: str = ""
    rank: RankRef = RankRef.NONE
    ranks: RankSet = RankSet.NONE
    exception_type: str = ""
    required_findings: tuple[str, ...] = ()
    forbidden_findings: tuple[str, ...] = ()
    note: str = ""

    def __post_init__(self) -> None:
        if self.category and self.category not in {c.value for c in Category}:
            raise ValueError(f"unknown category {self.category!r}")
        if self.verdict is not Verdict.OK and not self.category:
            raise ValueError("a failed or hung expectation needs a category")
        if self.rule and "." not in self.rule:
            raise ValueError(f"rule id {self.rule!r} is not <family>.<name>")

    def resolve(self, nproc: int, fault_rank: int) -> ResolvedExpectation:
        rank = {RankRef.FAULT: fault_rank, RankRef.LOWEST: 0, RankRef.NONE: None}[self.rank]
        ranks = tuple(range(nproc)) if self.ranks is RankSet.ALL else ()
        return ResolvedExpectation(
            verdict=self.verdict.value, category=self.category, rule=self.rule, rank=rank,
            ranks=ranks, exception_type=self.exception_type,
            required_findings=self.required_findings,
            forbidden_findings=self.forbidden_findings,
            note=self.note.replace("{fault}", str(fault_rank)).replace("{nproc}", str(nproc)),
        )


@dataclass(frozen=True)
class ResolvedExpectation:
    """An expectation with concrete ranks; ``to_dict`` is the expect.toml content."""

    verdict: str
    category: str
    rule: str
    rank: int | None
    ranks: tuple[int, ...]
    exception_type: str
    required_findings: tuple[str, ...]
    forbidden_findings: tuple[str, ...]
    note: str

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"verdict": self.verdict}
        for key in ("category", "rule"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        if self.rank is not None:
            out["rank"] = self.rank
        if self.ranks:
            out["ranks"] = list(self.ranks)
        if self.exception_type:
            out["exception_type"] = self.exception_type
        if self.required_findings:
            out["required_findings"] = list(self.required_findings)
        if self.forbidden_findings:
            out["forbidden_findings"] = list(self.forbidden_findings)
        if self.note:
            out["note"] = self.note
        return out


@dataclass(frozen=True)
class Variant:
    """One way to launch a scenario: sizes, launcher flags, environment, noise.

    Fields left at None fall back to the scenario's value. ``expect`` replaces the scenario's
    expectation when the variant changes what the log can show (e.g. a hidden traceback).
    """

    name: str
    nproc: int | None = None
    fault_rank: int | None = None
    script_args: tuple[str, ...] = ()
    launcher_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    launcher: Launcher = Launcher.TORCHRUN
    master_port: bool = True           # pass --master-port <free port> (False: let torchrun pick)
    occupy_master_port: bool = False   # hold the master port open so the launcher cannot bind it
    log_dir: bool = False              # pass --log-dir and keep the per-rank tree beside the log
    requires_modules: tuple[str, ...] = ()
    requires_programs: tuple[str, ...] = ()   # executables the launcher needs (mpirun)
    expect: Expectation | None = None
    evidence: str | None = None        # replaces the scenario's key message
    exit_code: int | None = None       # replaces the scenario's launcher exit code
    timeout_s: float | None = None


@dataclass(frozen=True)
class Scenario:
    """A fault script and the diagnosis every variant of it must get."""

    name: str
    description: str
    script: str                         # file name under logtriage/inject/scenarios/
    expect: Expectation
    variants: tuple[Variant, ...]
    evidence: str                       # a substring the captured log must contain ("" = none)
    exit_code: int = 1                  # the launcher's own exit code
    nproc: int = 2
    fault_rank: int = 1
    fault_on_rank: bool = True          # False: no --fault-rank (healthy, every-rank faults)
    script_args: tuple[str, ...] = ()
    backends: tuple[Backend, ...] = (Backend.GLOO,)
    requires_cuda: bool = False
    min_gpus: int = 0                   # 0: one GPU per rank when CUDA is needed
    code_bugs: tuple[CodeBug, ...] = ()
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        names = [v.name for v in self.variants]
        if not names:
            raise ValueError(f"scenario {self.name}: no variants")
        if len(set(names)) != len(names):
            raise ValueError(f"scenario {self.name}: duplicate variant names")
        if "__" in self.name or any("__" in n for n in names):
            raise ValueError(f"scenario {self.name}: '__' separates scenario and variant")

    def variant(self, name: str) -> Variant | None:
        return next((v for v in self.variants if v.name == name), None)
