"""Environment facts: structured probe lines (`LOGTRIAGE_ENVIRONMENT_JSON={...}`, any
`SOME_PREFIX_JSON=`), the container banner (NGC image and release), versions named in lines."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from logtriage.demux.line_marks import PROBE
from logtriage.demux.blocks import BANNER_TITLE

_RELEASE = re.compile(r"^NVIDIA Release (\S+)(?: \(build (\d+)\))?")
_FRAMEWORK_VERSION = re.compile(r"^(\w[\w ]*?) Version (\S+)")
MAX_PROBE_BYTES = 1 << 20


@dataclass
class Environment:
    facts: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.facts)
        if self.problems:
            out["probe_problems"] = list(self.problems)
        return out


def collect_environment(probes: list[tuple[int, int, int, str]], banner_lines: list[str], source_names: list[str],
                        probe_ranks: dict[int, int | None] | None = None) -> Environment:
    env = Environment()
    per_rank: dict[str, dict] = {}
    for source, line, _slot, text in probes:
        m = PROBE.match(text)
        if not m:
            continue
        name, payload = m.group(1), m.group(2)
        where = f"{source_names[source]}:{line}"
        if len(payload) > MAX_PROBE_BYTES:
            env.problems.append(f"{where}: {name} payload larger than 1 MiB, ignored")
            continue
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            env.problems.append(f"{where}: {name} is not valid JSON ({str(exc).splitlines()[0]})")
            continue
        if not isinstance(data, dict):
            env.problems.append(f"{where}: {name} is not a JSON object")
            continue
        key = f"{name}:{(probe_ranks or {}).get(line, '')}"
        per_rank.setdefault(key, data)
        for k, v in data.items():
            env.facts.setdefault(k, v)
        env.facts.setdefault("probe", name)
    if len(per_rank) > 1:
        differing = sorted({k for d in per_rank.values() for k in d
                            if any(o.get(k) != d.get(k) for o in per_rank.values())})
        if differing:
            env.facts["probe_differences"] = differing
    _banner(env, banner_lines)
    return env


def _banner(env: Environment, lines: list[str]) -> None:
    for text in lines:
        m = BANNER_TITLE.match(text)
        if m:
            env.facts.setdefault("container_image", m.group(1).strip())
            continue
        m = _RELEASE.match(text)
        if m:
            env.facts.setdefault("container_release", m.group(1))
            if m.group(2):
                env.facts.setdefault("container_build", m.group(2))
            continue
        m = _FRAMEWORK_VERSION.match(text)
        if m and "container_image" in env.facts:
            env.facts.setdefault(f"container_{m.group(1).strip().lower().replace(' ', '_')}_version", m.group(2))
