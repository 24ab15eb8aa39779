"""Write the two files beside each captured log: ``<name>.expect.toml`` and
``<name>.provenance.json`` (formats in docs/architecture.md).

Both are free of host names, user names and absolute paths: the command has its workspace and
interpreter paths rewritten by the workspace, and nothing else machine-specific is recorded.
"""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path

from logtriage.inject.model import ResolvedExpectation
from logtriage.inject.runner import RunResult

EXPECT_HEADER = "# Written by `triage inject` from the scenario's declaration ({scenario}).\n"


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def expect_toml(expectation: ResolvedExpectation, scenario: str) -> str:
    lines = [EXPECT_HEADER.format(scenario=scenario)]
    lines += [f"{key} = {toml_value(value)}\n" for key, value in expectation.to_dict().items()]
    return "".join(lines)


def _torch_version() -> str:
    try:
        import torch
    except ImportError:
        return ""
    return torch.__version__


def provenance(result: RunResult) -> dict[str, object]:
    plan = result.plan
    record: dict[str, object] = {
        "source": "triage inject",
        "scenario": plan.scenario.name,
        "variant": plan.variant.name,
        "command": result.command,
        "launcher": plan.variant.launcher.value,
        "torch": _torch_version(),
        "python": platform.python_version(),
        "backend": plan.backend.value,
        "world_size": plan.nproc,
        "fault_rank": plan.fault_rank if plan.scenario.fault_on_rank else None,
        "exit_code": result.exit_code,
        "duration_s": result.duration_s,
        "timed_out": result.status.value == "timed_out",
        "captured": datetime.date.today().isoformat(),
        "notes": plan.scenario.description,
    }
    if plan.variant.env:
        record["env"] = dict(plan.variant.env)
    if result.log_dir_copy is not None:
        record["log_dir"] = result.log_dir_copy.name + "/"
    return record


def write_sidecars(result: RunResult) -> tuple[Path, Path]:
    """Write both sidecars next to ``result.log_path``; returns their paths."""
    assert result.log_path is not None
    stem = result.log_path.with_suffix("")
    expect_path = stem.with_name(stem.name + ".expect.toml")
    provenance_path = stem.with_name(stem.name + ".provenance.json")
    expect_path.write_text(expect_toml(result.plan.expectation, result.plan.scenario.name),
                           encoding="utf-8")
    provenance_path.write_text(
        json.dumps(provenance(result), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return expect_path, provenance_path
