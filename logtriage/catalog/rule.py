"""A catalog rule: the value loaded from one TOML file, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping


class Category(str, Enum):
    COLLECTIVE_TIMEOUT = "collective_timeout"
    COLLECTIVE_ERROR = "collective_error"
    COLLECTIVE_MISMATCH = "collective_mismatch"
    GPU_OOM = "gpu_oom"
    HOST_OOM = "host_oom"
    NUMERICAL = "numerical"
    CRASH_SIGNAL = "crash_signal"
    PYTHON_EXCEPTION = "python_exception"
    RENDEZVOUS = "rendezvous"
    DEVICE_ASSIGNMENT = "device_assignment"
    DDP_USAGE = "ddp_usage"
    CHECKPOINT = "checkpoint"
    ENVIRONMENT = "environment"
    LAUNCH_USAGE = "launch_usage"
    CUDA_RUNTIME = "cuda_runtime"
    EXTERNAL_STOP = "external_stop"
    PERFORMANCE_VALIDITY = "performance_validity"
    HANG = "hang"
    UNKNOWN = "unknown"


class Role(str, Enum):
    ROOT_CANDIDATE = "root_candidate"
    CASCADE_CANDIDATE = "cascade_candidate"
    CAUSE_CONFIRMATION = "cause_confirmation"
    EITHER = "either"
    CONTEXT = "context"


class Layer(str, Enum):
    LAUNCHER = "launcher"
    CONTAINER = "container"
    MODEL_RUNTIME = "model_runtime"
    COLLECTIVE = "collective"
    CHECKPOINT = "checkpoint"
    REPORT = "report"


class Severity(str, Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


class Engine(str, Enum):
    RE2 = "re2"      # linear time; the default
    REGEX = "regex"  # look-around/backrefs; run with a time limit


REQUIRED_FIELDS = ("id", "title", "category", "role")
DOC_FIELDS = ("layer", "explanation", "fix", "misdiagnosis", "references")
KNOWN_FIELDS = frozenset(REQUIRED_FIELDS + DOC_FIELDS + (
    "patterns", "severity", "priority", "aliases", "status", "engine", "examples",
    "counterexamples", "derived", "teardown", "benign_at_warning_level", "stuck", "recovered_by",
))


class RuleValueError(ValueError):
    """One problem with one field of a rule; `key` says which, for the path:line of the message."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(message)


@dataclass(frozen=True)
class Example:
    line: str
    captures: Mapping[str, str] = field(default_factory=dict)
    source: str = ""


@dataclass(frozen=True)
class Rule:
    id: str
    title: str
    category: Category
    role: Role
    patterns: tuple[str, ...]
    layer: Layer | None = None
    severity: Severity = Severity.ERROR
    priority: int = 50
    engine: Engine = Engine.RE2
    explanation: str = ""
    fix: str = ""
    misdiagnosis: str = ""
    references: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    status: str = "stable"
    examples: tuple[Example, ...] = ()
    counterexamples: tuple[Example, ...] = ()
    derived: bool = False  # no patterns: produced by the analysis (e.g. hang.no_progress)
    teardown: bool = False  # the launcher tearing the job down (SIGTERM to survivors, summary)
    # on a line its program logged at WARNING level (`[W socket.cpp:601] ...`) the text is not an
    # error: the program goes on (c10d retries an address it could not resolve)
    benign_at_warning_level: bool = False
    # as a root: the job was stuck when something stopped it (a test harness's timeout): verdict hung
    stuck: bool = False
    # rule ids whose finding a little later in the same process says the program went on from this
    # one (NCCL's `NET/IB : Using [0]mlx5_1` after a device it could not open; Inductor's `Ignoring
    # this choice.` after an autotune candidate's CUDA error): then this finding is no error
    recovered_by: tuple[str, ...] = ()
    path: str = ""

    @property
    def family(self) -> str:
        return self.id.split(".", 1)[0]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], path: str = "") -> "Rule":
        """Build a rule from parsed TOML; raises RuleValueError naming the offending key."""
        for key in REQUIRED_FIELDS:
            if not isinstance(data.get(key), str) or not data[key].strip():
                raise RuleValueError(key, f"missing or empty required field '{key}'")
        unknown = sorted(set(data) - KNOWN_FIELDS)
        if unknown:
            raise RuleValueError(unknown[0], f"unknown field(s): {', '.join(unknown)}")
        derived = bool(data.get("derived", False))
        patterns = data.get("patterns", [])
        if isinstance(patterns, str):
            patterns = [patterns]
        if not isinstance(patterns, list) or not all(isinstance(p, str) and p for p in patterns):
            raise RuleValueError("patterns", "'patterns' must be a list of non-empty strings")
        if not patterns and not derived:
            raise RuleValueError("patterns", "a rule needs at least one pattern (or derived = true)")
        return cls(
            id=data["id"].strip(),
            title=data["title"].strip(),
            category=_enum(Category, data, "category"),
            role=_enum(Role, data, "role"),
            patterns=tuple(patterns),
            layer=_enum(Layer, data, "layer") if "layer" in data else None,
            severity=_enum(Severity, data, "severity") if "severity" in data else Severity.ERROR,
            priority=_int(data, "priority", 50),
            engine=_enum(Engine, data, "engine") if "engine" in data else Engine.RE2,
            explanation=_text(data, "explanation"),
            fix=_text(data, "fix"),
            misdiagnosis=_text(data, "misdiagnosis"),
            references=_strings(data, "references"),
            aliases=_strings(data, "aliases"),
            status=_text(data, "status") or "stable",
            examples=_examples(data, "examples"),
            counterexamples=_examples(data, "counterexamples"),
            derived=derived,
            teardown=bool(data.get("teardown", False)),
            benign_at_warning_level=bool(data.get("benign_at_warning_level", False)),
            stuck=bool(data.get("stuck", False)),
            recovered_by=_strings(data, "recovered_by"),
            path=path,
        )

    def describe(self) -> dict[str, Any]:
        """Plain data for `triage explain --format json`."""
        return {
            "id": self.id, "title": self.title, "category": self.category.value,
            "layer": self.layer.value if self.layer else None, "role": self.role.value,
            "severity": self.severity.value, "priority": self.priority, "teardown": self.teardown,
            "benign_at_warning_level": self.benign_at_warning_level, "stuck": self.stuck,
            "recovered_by": list(self.recovered_by), "aliases": list(self.aliases), "status": self.status, "patterns": list(self.patterns),
            "explanation": self.explanation, "fix": self.fix, "misdiagnosis": self.misdiagnosis,
            "references": list(self.references), "path": self.path,
            "examples": [e.line for e in self.examples],
        }


def _enum(enum: type[Enum], data: Mapping[str, Any], key: str):
    value = data.get(key)
    try:
        return enum(value)
    except ValueError:
        allowed = ", ".join(m.value for m in enum)
        raise RuleValueError(key, f"'{key}' = {value!r} is not one of: {allowed}") from None


def _int(data: Mapping[str, Any], key: str, default: int) -> int:
    value = data.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise RuleValueError(key, f"'{key}' must be an integer")
    return value


def _text(data: Mapping[str, Any], key: str) -> str:
    value = data.get(key, "")
    if not isinstance(value, str):
        raise RuleValueError(key, f"'{key}' must be a string")
    return value.strip()


def _strings(data: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = data.get(key, [])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RuleValueError(key, f"'{key}' must be a list of strings")
    return tuple(value)


def _examples(data: Mapping[str, Any], key: str) -> tuple[Example, ...]:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise RuleValueError(key, f"'{key}' must be an array of tables ([[{key}]])")
    out = []
    for item in value:
        if isinstance(item, str):
            item = {"line": item}
        if not isinstance(item, dict) or not isinstance(item.get("line"), str):
            raise RuleValueError(key, f"each [[{key}]] needs a string 'line'")
        captures = item.get("captures", {})
        if not isinstance(captures, dict):
            raise RuleValueError(key, f"'captures' in [[{key}]] must be a table")
        out.append(Example(item["line"], {k: str(v) for k, v in captures.items()},
                           str(item.get("source", ""))))
    return tuple(out)
