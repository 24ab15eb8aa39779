"""numba checks a cached function only against its own source file: the kernel's cache is dropped when any of
the kernel's sources changed (a byte reader edited in kernel_markers.py, kernel.py untouched), and kept when
none did."""

from __future__ import annotations

import shutil
from pathlib import Path

import logtriage.fastscan as fastscan
from logtriage.fastscan.kernel_cache import SOURCES, STAMP, drop_stale_cache, sources_digest

HERE = Path(fastscan.__file__).resolve().parent


def _tree(tmp_path: Path) -> Path:
    folder = tmp_path / "fastscan"
    (folder / "__pycache__").mkdir(parents=True)
    for pattern in SOURCES:
        for path in HERE.glob(pattern):
            shutil.copy(path, folder / path.name)
    for name in ("kernel.classify-157.py311.nbi", "kernel.classify-157.py311.1.nbc",
                 "kernel_markers.marker-44.py311.nbi", "driver.cpython-311.pyc"):
        (folder / "__pycache__" / name).write_bytes(b"x")
    return folder


def test_an_edited_reader_drops_the_whole_kernels_cache(tmp_path):
    folder = _tree(tmp_path)
    assert drop_stale_cache(folder)   # no stamp yet: whatever is there may be stale
    left = sorted(p.name for p in (folder / "__pycache__").iterdir())
    assert left == ["driver.cpython-311.pyc", STAMP]
    assert (folder / "__pycache__" / STAMP).read_text().strip() == sources_digest(folder)

    (folder / "__pycache__" / "kernel.classify-157.py311.nbi").write_bytes(b"x")   # numba compiles and stores
    assert not drop_stale_cache(folder)                                          # nothing changed: kept
    assert (folder / "__pycache__" / "kernel.classify-157.py311.nbi").exists()
    (folder / "kernel_cache.py").write_text("# the guard itself is no kernel source\n")
    assert not drop_stale_cache(folder)

    markers = folder / "kernel_markers.py"
    markers.write_text(markers.read_text() + "\n# an edited reader\n")
    assert drop_stale_cache(folder)
    assert not (folder / "__pycache__" / "kernel.classify-157.py311.nbi").exists()


def test_a_cache_folder_that_cannot_be_written_is_left_to_numba(tmp_path):
    folder = _tree(tmp_path)
    shutil.rmtree(folder / "__pycache__")
    (folder / "__pycache__").write_text("not a folder")   # (root writes anywhere; a file stands in for it)
    assert drop_stale_cache(folder) is False
    assert (folder / "__pycache__").read_text() == "not a folder"
