"""The *.expect.toml sidecar of a generated log (format: docs/architecture.md).

Besides the documented keys it carries `line`: the 1-based line of the root-cause evidence
(the OOM or exception line, the agent's `failed (exitcode: -9)` line, or for a hang the first
desync-report line naming the hung rank).
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.loggen.layout import Topology, Worker
from benchmarks.loggen.spec import EXPECTED_ROOT, Expectation, FailureKind, GenSpec


def build_expectation(spec: GenSpec, topo: Topology, culprit: Worker | None, size: int, lines: int,
                      line: int, line_text: str, exc_type: str) -> Expectation:
    verdict, category, rule = EXPECTED_ROOT[spec.failure]
    kind = spec.failure
    if culprit is None:
        return Expectation(verdict, category, rule, None, 0, "", note=f"healthy run, {spec.ranks} ranks, exit 0",
                           lines_total=lines, bytes_total=size)
    multi = spec.nodes > 1
    required = ["launcher.child_failed"]
    if kind is FailureKind.TIMEOUT:
        required += ["nccl.desync_report"]
    elif multi:
        required += ["launcher.sigterm_sent", "nccl.watchdog_timeout"]
    elif spec.ranks_per_node > 1:
        required.append("launcher.sigterm_sent")
    where = f"rank {culprit.rank} ({culprit.host}, local_rank {culprit.local})"
    notes = {
        FailureKind.OOM: f"{where} raises torch.OutOfMemoryError",
        FailureKind.EXCEPTION: f"{where} raises {exc_type}",
        FailureKind.SIGKILL: f"{where} is killed with SIGKILL and prints nothing; its agent reports exitcode -9",
        FailureKind.TIMEOUT: f"{where} stops joining collectives; every other rank hits the NCCL watchdog "
                             f"timeout and the desync report names rank {culprit.rank} as lagging",
    }
    note = notes[kind]
    if kind is not FailureKind.TIMEOUT:
        note += "; its node's agent SIGTERMs the node's other ranks"
        if multi:
            note += "; the ranks on the other nodes hit the NCCL watchdog timeout and abort (SIGABRT)"
    return Expectation(verdict, category, rule, culprit.rank, line, line_text,
                       exception_type=exc_type, required_findings=tuple(required), note=note,
                       lines_total=lines, bytes_total=size)


def sidecar_path(log: Path) -> Path:
    """`run.log` -> `run.expect.toml` (named after the log without its extension)."""
    stem = log.name[: -len(log.suffix)] if log.suffix else log.name
    return log.with_name(stem + ".expect.toml")


def _s(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def render_sidecar(spec: GenSpec, exp: Expectation) -> str:
    out = [
        "# Written by benchmarks/generate.py; regenerate with:",
        f"#   python benchmarks/generate.py {spec.args_line()} --out LOG",
        f"# {exp.lines_total} lines, {exp.bytes_total} bytes",
    ]
    if exp.line:
        shown = exp.line_text if len(exp.line_text) <= 160 else exp.line_text[:157] + "..."
        out.append(f"# line {exp.line}: {shown}")
    out += [f"verdict = {_s(exp.verdict)}"]
    if exp.category:
        out.append(f"category = {_s(exp.category)}")
    if exp.rule:
        out.append(f"rule = {_s(exp.rule)}")
    if exp.rank is not None:
        out.append(f"rank = {exp.rank}")
    if exp.exception_type:
        out.append(f"exception_type = {_s(exp.exception_type)}")
    if exp.required_findings:
        out.append("required_findings = [" + ", ".join(_s(f) for f in exp.required_findings) + "]")
    out.append(f"line = {exp.line}")
    out.append(f"note = {_s(exp.note)}")
    return "\n".join(out) + "\n"


def write_sidecar(log: Path, spec: GenSpec, exp: Expectation) -> Path:
    path = sidecar_path(log)
    path.write_text(render_sidecar(spec, exp), encoding="utf-8")
    return path
