"""A cache of parsed rule files, keyed by each file's exact text, so a run does not re-parse TOML it has seen.

Parsing the 314 built-in rule files with `tomllib` takes about 0.2 s of every run, more than the whole scan of a
small log; a user directory of thousands of rules takes seconds. A rule file's parsed table depends on nothing
but its text, so the cache keys each entry by a digest of the text: an edited file misses and is parsed again, and
a stale entry can never be served. One cache file holds one rules directory (named by a digest of its resolved
path and this Python's version), written whole and atomically after a load that parsed anything new.

The cache lives in $LOGTRIAGE_CACHE_DIR, else the user's cache directory; LOGTRIAGE_CACHE_DIR set to an empty
string turns it off. Every failure to read or write it is silent: the cache only saves time, never changes a
result. Only tables of plain JSON values are stored (a TOML date would not come back as a date), and a file that
does not parse is never stored, so its error is reported on every load as before.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

CACHE_ENV = "LOGTRIAGE_CACHE_DIR"
FORMAT = 1
_PLAIN = (str, int, float, bool)


def cache_root() -> Path | None:
    """$LOGTRIAGE_CACHE_DIR (empty: no cache), else the user's cache directory."""
    if CACHE_ENV in os.environ:
        value = os.environ[CACHE_ENV]
        return Path(value).expanduser() if value else None
    import platformdirs
    return Path(platformdirs.user_cache_dir("logtriage"))


def text_key(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


class ParseCache:
    """The parsed tables of one rules directory: `get` by (relative name, text key), `put`, then `save`."""

    def __init__(self, directory: Path, root: Path | None = None) -> None:
        root = cache_root() if root is None else root
        self._path = None if root is None else root / _file_name(directory)
        self._old: dict[str, list[Any]] = self._read()
        self._new: dict[str, list[Any]] = {}
        self._changed = False

    def get(self, name: str, key: str) -> dict[str, Any] | None:
        entry = self._old.get(name)
        if entry is None or entry[0] != key:
            return None
        self._new[name] = entry
        return entry[1]

    def put(self, name: str, key: str, table: dict[str, Any]) -> None:
        if self._path is not None and _is_plain(table):
            self._new[name] = [key, table]
            self._changed = True

    def save(self) -> None:
        """Write the entries this load used, when any was new or any old one went unused."""
        if self._path is None or not (self._changed or self._new.keys() != self._old.keys()):
            return
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            blob = orjson.dumps({"format": FORMAT, "files": self._new})
            handle, temporary = tempfile.mkstemp(dir=self._path.parent, prefix=".parse-", suffix=".tmp")
            try:
                with os.fdopen(handle, "wb") as out:
                    out.write(blob)
                os.replace(temporary, self._path)
            except BaseException:
                os.unlink(temporary)
                raise
        except (OSError, TypeError, orjson.JSONEncodeError):
            return

    def _read(self) -> dict[str, list[Any]]:
        if self._path is None:
            return {}
        try:
            data = orjson.loads(self._path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("files"), dict):
            return {}
        return {name: entry for name, entry in data["files"].items()
                if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], dict)}


def _file_name(directory: Path) -> str:
    where = os.fsencode(directory.resolve())
    version = f"{sys.version_info[0]}.{sys.version_info[1]}".encode()
    return f"rules-{hashlib.blake2b(where + b'|' + version, digest_size=12).hexdigest()}.json"


def _is_plain(value: Any) -> bool:
    """Only str, int, float, bool, lists and tables survive a JSON round trip unchanged (no dates, no NaN, no integer
    wider than 64 bits)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_is_plain(v) for v in value)
    if isinstance(value, float):
        return value == value and value not in (float("inf"), float("-inf"))
    if isinstance(value, int) and not isinstance(value, bool):
        return -(2 ** 63) <= value < 2 ** 64
    return isinstance(value, _PLAIN)
