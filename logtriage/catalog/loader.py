"""Load rule files strictly and report every problem with path:line, keeping the good rules."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Iterable

from logtriage.catalog.compiled import CompiledRule, PatternError, compile_rule
from logtriage.catalog.parse_cache import ParseCache, text_key
from logtriage.catalog.rule import Rule, RuleValueError
from logtriage.errors import CatalogError

PATTERNS_ENV = "LOGTRIAGE_PATTERNS"


@dataclass(frozen=True)
class Catalog:
    rules: tuple[CompiledRule, ...]
    problems: tuple[str, ...]

    def get(self, name: str) -> Rule | None:
        """A rule by id or alias (case-insensitive for aliases such as E007)."""
        for compiled in self.rules:
            if compiled.rule.id == name:
                return compiled.rule
        lowered = name.lower()
        for compiled in self.rules:
            if lowered in (a.lower() for a in compiled.rule.aliases):
                return compiled.rule
        return None

    def strict(self) -> "Catalog":
        if self.problems:
            raise CatalogError(list(self.problems))
        return self


def builtin_dir() -> Path:
    """The shipped catalog: inside the installed package, else the checkout's patterns/."""
    packaged = resources.files("logtriage") / "_builtin_patterns"
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[2] / "patterns"


def user_dirs(explicit: Iterable[str | os.PathLike] = ()) -> list[Path]:
    dirs = [Path(d) for d in explicit]
    env = os.environ.get(PATTERNS_ENV, "")
    dirs += [Path(d) for d in env.split(os.pathsep) if d]
    return dirs


def load_catalog(extra_dirs: Iterable[str | os.PathLike] = (), include_builtin: bool = True) -> Catalog:
    """Every rule file under the built-in catalog and the user's directories. A user rule with a
    built-in id replaces it. Problems are collected, never raised (see Catalog.strict)."""
    problems: list[str] = []
    by_id: dict[str, CompiledRule] = {}
    sources = ([(builtin_dir(), True)] if include_builtin else []) + [(d, False) for d in user_dirs(extra_dirs)]
    for directory, builtin in sources:
        if not directory.is_dir():
            problems.append(f"{_shown(directory)}: rules directory not found")
            continue
        seen_here: dict[str, str] = {}
        parsed = ParseCache(directory)
        for path in sorted(directory.rglob("*.toml")):
            compiled = _load_file(path, builtin, problems, parsed, os.fsencode(path.relative_to(directory)).hex())
            if compiled is None:
                continue
            rule_id = compiled.rule.id
            if rule_id in seen_here:
                problems.append(f"{_shown(path)}:{_line_of(path, 'id')}: duplicate id '{rule_id}' (also in {seen_here[rule_id]})")
                continue
            seen_here[rule_id] = _shown(path)
            by_id[rule_id] = compiled
        parsed.save()
    return Catalog(tuple(by_id.values()), tuple(problems))


def _load_file(path: Path, builtin: bool, problems: list[str], parsed: ParseCache, name: str) -> CompiledRule | None:
    try:
        text = path.read_text(encoding="utf-8")
        key = text_key(text)
        data = parsed.get(name, key)
        if data is None:
            data = tomllib.loads(text)
            parsed.put(name, key, data)
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(f"{_shown(path)}:1: cannot read: {exc}")
        return None
    except tomllib.TOMLDecodeError as exc:
        line = getattr(exc, "lineno", None) or _toml_error_line(str(exc))
        problems.append(f"{_shown(path)}:{line}: invalid TOML: {exc}")
        return None
    try:
        rule = Rule.from_dict(data, _shown(path))
    except RuleValueError as exc:
        problems.append(f"{_shown(path)}:{_line_in(text, exc.key)}: {exc}")
        return None
    try:
        return compile_rule(rule, allow_fallback=not builtin)
    except PatternError as exc:
        problems.append(f"{_shown(path)}:{_pattern_line(text, exc.pattern)}: {rule.id}: {exc}")
        return None


def _shown(path: Path) -> str:
    """A path for messages: bytes of a non-UTF-8 file name as \\xNN (JSON cannot hold surrogates)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _line_in(text: str, key: str) -> int:
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        if stripped.startswith(key) and stripped[len(key):].lstrip().startswith(("=", "]")):
            return number
        if stripped.startswith(f"[[{key}]]"):
            return number
    return 1


def _line_of(path: Path, key: str) -> int:
    try:
        return _line_in(path.read_text(encoding="utf-8"), key)
    except OSError:
        return 1


def _pattern_line(text: str, pattern: str) -> int:
    probe = pattern[:40]
    for number, line in enumerate(text.splitlines(), 1):
        if probe and probe in line:
            return number
    return _line_in(text, "patterns")


def _toml_error_line(message: str) -> int:
    import re
    m = re.search(r"line (\d+)", message)
    return int(m.group(1)) if m else 1
