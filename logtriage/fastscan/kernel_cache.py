"""Keeps numba's on-disk cache of the fast path's kernel in step with its sources.

numba caches each compiled function beside its own source file (`__pycache__/<module>.<function>-<line>.
py311.nbi/.nbc`) and checks only that file's time and size: a kernel function compiled with a byte reader of
kernel_markers.py inlined keeps the old reader after kernel_markers.py changes, as long as kernel.py itself does
not (a `git pull` into an editable install). The fast engine would then read ranks the exact path no longer
reads. Before the kernel's first call, the digest of all the kernel's sources is compared with the one stored
beside the cache; where they differ, the kernel's cache files are dropped and numba compiles afresh.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SOURCES = ("kernel*.py", "flags.py")      # the compiled kernel's modules, and the flags it sets
STAMP = "kernel_sources.sha256"


def sources_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted({p for pattern in SOURCES for p in folder.glob(pattern)} - {folder / "kernel_cache.py"}):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def drop_stale_cache(folder: Path = Path(__file__).resolve().parent) -> bool:
    """Drop the kernel's cached machine code in `folder`/__pycache__ if its sources changed since it was
    stored; True when something was dropped. A cache folder that cannot be written is left to numba
    (it then caches elsewhere, or not at all)."""
    cache = folder / "__pycache__"
    digest = sources_digest(folder)
    stamp = cache / STAMP
    try:
        if stamp.is_file() and stamp.read_text().strip() == digest:
            return False
        stale = list(cache.glob("kernel*.nb[ic]")) if cache.is_dir() else []
        for path in stale:
            path.unlink(missing_ok=True)
        cache.mkdir(exist_ok=True)
        stamp.write_text(digest + "\n")
    except OSError:
        return False
    return bool(stale)
