"""Find the inputs: files, stdin, folders (torchrun --log-dir layout or per-rank files), .gz.

Line numbers in reports are 1-based within each source file; a report on a folder names the
source file of every line it cites.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from logtriage.errors import InputError

STDIN = "-"
GZIP_MAGIC = b"\x1f\x8b"


def starts_gzip(path) -> bool:
    """Whether the file starts with the gzip magic (OSError when it cannot be read)."""
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def utf16_codec(head: bytes) -> str | None:
    """The codec of a UTF-16 text (PowerShell's `>` writes UTF-16LE with a byte-order mark;
    Notepad's "Unicode" too), from its first bytes, else None: a BOM, or, without one, ASCII
    text with a NUL in every other byte."""
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "utf-16"
    sample = head[:4096]
    if len(sample) < 16:
        return None
    odd, even = sample[1::2], sample[0::2]
    if odd.count(0) > 0.9 * len(odd) and even.count(0) < 0.1 * len(even):
        return "utf-16-le"
    if even.count(0) > 0.9 * len(even) and odd.count(0) < 0.1 * len(odd):
        return "utf-16-be"
    return None


def needs_stream(path) -> bool:
    """Whether the file's bytes are not its lines as stored: gzip, or UTF-16 to transcode
    (OSError when it cannot be read)."""
    with open(path, "rb") as f:
        head = f.read(4096)
    return head[:2] == GZIP_MAGIC or utf16_codec(head) is not None
# torchrun --log-dir: <dir>/<run_id>/attempt_<n>/<local_rank>/{stdout,stderr}.log
_LOGDIR_FILE = re.compile(r"(?:^|/)attempt_(\d{1,9})/(\d{1,9})/(stdout|stderr)\.log(?:\.gz)?$")
# other per-rank files: rank3.log, rank_3.txt, log_rank-03.out, worker3.err, 3.log
_RANK_NAME = re.compile(r"(?:rank|worker|proc|process)[_-]?(\d{1,6})(?!\d)", re.IGNORECASE)
_BARE_NUMBER_NAME = re.compile(r"^(\d{1,6})\.(?:log|txt|out|err)(?:\.gz)?$")
_SKIP_SUFFIXES = (".json", ".pt", ".pth", ".bin", ".safetensors", ".npy", ".npz", ".pkl", ".png", ".jpg",
                  ".so", ".pyc", ".zip", ".tar", ".db", ".sqlite", ".toml", ".yaml", ".yml", ".py")


@dataclass(frozen=True)
class Source:
    index: int
    name: str                     # as shown in reports: the path as given, or "<stdin>"
    path: Path | None             # None for stdin
    rank_hint: int | None = None  # a per-rank file names its rank
    attempt_hint: int | None = None
    channel: str | None = None    # "stdout" / "stderr" for --log-dir files

    @property
    def is_stdin(self) -> bool:
        return self.path is None


@dataclass(frozen=True)
class Discovery:
    sources: tuple[Source, ...]
    skipped: tuple[str, ...]      # "path: why" for files left out of a folder


def discover(inputs: Iterable[str]) -> Discovery:
    """Expand the user's inputs into sources, in a stable order. Raises InputError for a missing or
    unreadable file named directly, or a folder with nothing readable in it."""
    sources: list[Source] = []
    skipped: list[str] = []
    stdin_used = False
    for given in inputs:
        if given == STDIN:
            if stdin_used:
                raise InputError("standard input ('-') given twice")
            stdin_used = True
            sources.append(Source(len(sources), "<stdin>", None))
            continue
        path = Path(given)
        try:
            st = path.stat()
        except FileNotFoundError:
            raise InputError(f"{given}: no such file or directory") from None
        except OSError as exc:
            raise InputError(f"{given}: cannot read ({exc.strerror or exc})") from None
        if stat.S_ISDIR(st.st_mode):
            found = _walk_folder(path, given, skipped)
            if not found:
                raise InputError(f"{given}: folder holds no readable log files")
            for name, file_path, hints in found:
                sources.append(Source(len(sources), display_name(name), file_path, *hints))
        else:
            if not os.access(path, os.R_OK):
                raise InputError(f"{given}: permission denied")
            sources.append(Source(len(sources), display_name(given), path))
    if not sources:
        raise InputError("no input: give a log file, a folder, or '-' for standard input")
    return Discovery(tuple(sources), tuple(display_name(s) for s in skipped))


def display_name(name: str) -> str:
    """A path as reports show it. A file name that is not UTF-8 reaches Python with surrogate
    escapes, which no UTF-8 output (JSON, a report file) can hold: its bytes are shown as \\xNN."""
    try:
        return os.fsencode(name).decode("utf-8", "backslashreplace")
    except UnicodeError:
        return name.encode("utf-8", "backslashreplace").decode("utf-8")


def _walk_folder(root: Path, given: str, skipped: list[str]):
    found = []
    seen_dirs: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False, onerror=lambda e: skipped.append(f"{e.filename}: {e.strerror}")):
        try:
            st = os.stat(dirpath)
            key = (st.st_dev, st.st_ino)
        except OSError:
            continue
        if key in seen_dirs:
            dirnames[:] = []
            continue
        seen_dirs.add(key)
        dirnames.sort()
        for filename in sorted(filenames):
            full = Path(dirpath) / filename
            rel = full.relative_to(root).as_posix()
            if filename.startswith(".") or filename.lower().endswith(_SKIP_SUFFIXES):
                continue
            try:
                st = full.stat()
            except OSError as exc:
                skipped.append(f"{rel}: {exc.strerror or exc}")
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if not os.access(full, os.R_OK):
                skipped.append(f"{rel}: permission denied")
                continue
            name = f"{given.rstrip('/')}/{rel}"
            found.append((name, full, _hints(rel)))
    return found


def _hints(rel: str) -> tuple[int | None, int | None, str | None]:
    m = _LOGDIR_FILE.search(rel)
    if m:
        return int(m.group(2)), int(m.group(1)), m.group(3)
    base = rel.rsplit("/", 1)[-1]
    m = _RANK_NAME.search(base) or _BARE_NUMBER_NAME.match(base)
    if m:
        return int(m.group(1)), None, None
    return None, None, None
