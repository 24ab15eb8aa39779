"""A neutral working folder for scenario runs, so captured logs hold no user or project paths.

Tracebacks and launcher lines print absolute paths: the script's, the venv's (torch frames,
``of binary: .../bin/python``) and the standard library's. The workspace makes all of them live
under one neutral folder (default ``/tmp/logtriage-inject``):

    scenarios/            copies of the scenario scripts (run as ``scenarios/NAME.py``)
    .python -> <the interpreter's base prefix>
    .venv/                a venv whose python is .python/bin/pythonX.Y, whose site-packages
                          links every entry of the real site-packages, and whose torchrun is the
                          installed console script with its first line pointed at .venv/bin/python
    run/                  per-run scratch (checkpoints), emptied before each run
    logs/                 the --log-dir of log-dir variants, emptied before each run

torch's launcher log formatter resolves symlinks and prints paths relative to an entry of
``sys.path``; a .pth file therefore appends the real site-packages as well, so the launcher
lines keep their usual ``torch/distributed/run.py`` shape. When the neutral venv cannot be built
(no symlinks, an unusual layout) the runner falls back to the real interpreter.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from logtriage.errors import UsageError

DEFAULT_ROOT = Path("/tmp/logtriage-inject")
SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"
PACKAGE_PARENT = Path(__file__).resolve().parents[2]
_PTH_NAME = "zz_logtriage_inject_paths.pth"


@dataclass(frozen=True)
class Workspace:
    root: Path
    python: Path         # the interpreter the launcher and workers run
    torchrun: Path       # the torchrun console script run by that interpreter
    neutral: bool        # False: fell back to the real interpreter (paths will leak)

    @property
    def scratch(self) -> Path:
        return self.root / "run"

    @property
    def log_dir(self) -> Path:
        return self.root / "logs"

    def reset_run_dirs(self) -> None:
        for folder in (self.scratch, self.log_dir):
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)

    def display(self, text: str) -> str:
        """Rewrite workspace and interpreter paths for provenance: nothing absolute remains."""
        replacements = [
            (f"{self.python} {self.torchrun}", "torchrun"),
            (str(self.torchrun), "torchrun"),
            (str(self.python), "python"),
            (sys.executable, "python"),
            (str(self.root) + os.sep, ""),
            (str(self.root), "."),
        ]
        for old, new in replacements:
            text = text.replace(old, new)
        return text


class WorkspaceLock:
    """An exclusive lock on the workspace: two concurrent suites would clobber each other."""

    def __init__(self, root: Path):
        self.root = root
        self._handle = None

    def __enter__(self) -> WorkspaceLock:
        self.root.mkdir(parents=True, exist_ok=True)
        self._handle = open(self.root / ".lock", "w")
        try:
            fcntl.flock(self._handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._handle.close()
            raise UsageError(f"another `triage inject` run is using {self.root}; "
                             "wait for it or pass --workdir") from None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()


def prepare(root: Path = DEFAULT_ROOT) -> Workspace:
    """Copy the scripts and build the neutral venv (or fall back to the real interpreter)."""
    root.mkdir(parents=True, exist_ok=True)
    scripts = root / "scenarios"
    shutil.rmtree(scripts, ignore_errors=True)
    shutil.copytree(SCENARIO_DIR, scripts, ignore=shutil.ignore_patterns("__pycache__"))
    try:
        workspace = _neutral_venv(root)
    except OSError:
        workspace = None
    if workspace is None:
        workspace = Workspace(root, Path(sys.executable), _real_torchrun(), neutral=False)
    workspace.reset_run_dirs()
    return workspace


def _real_torchrun() -> Path:
    candidate = Path(sys.executable).parent / "torchrun"
    if not candidate.exists():
        raise UsageError(f"torchrun not found beside {sys.executable}; install torch "
                         "(pip install 'logtriage[inject]')")
    return candidate


def _site_dirs() -> list[Path]:
    dirs = [Path(sysconfig.get_paths()["purelib"])] + [Path(p) for p in site.getsitepackages()]
    unique: list[Path] = []
    for folder in dirs:
        if folder.is_dir() and folder not in unique:
            unique.append(folder)
    return unique


def _neutral_venv(root: Path) -> Workspace | None:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    base_python = Path(sys.base_prefix) / "bin" / f"python{version}"
    real_torchrun = _real_torchrun()
    if not base_python.exists():
        return None
    base_link = root / ".python"
    venv = root / ".venv"
    shutil.rmtree(venv, ignore_errors=True)
    if base_link.is_symlink() or base_link.exists():
        base_link.unlink()
    base_link.symlink_to(sys.base_prefix, target_is_directory=True)
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(
        f"home = {base_link / 'bin'}\ninclude-system-site-packages = false\nversion = "
        f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}\n")
    python = venv / "bin" / "python"
    python.symlink_to(base_link / "bin" / f"python{version}")
    site_dir = venv / "lib" / f"python{version}" / "site-packages"
    site_dir.mkdir(parents=True)
    real_sites = _site_dirs()
    for real_site in real_sites:
        for entry in real_site.iterdir():
            link = site_dir / entry.name
            if entry.name != "__pycache__" and not link.exists() and not link.is_symlink():
                link.symlink_to(entry)
    extra = [str(p) for p in real_sites] + [str(PACKAGE_PARENT)]
    (site_dir / _PTH_NAME).write_text("\n".join(extra) + "\n")
    lines = real_torchrun.read_text().splitlines(keepends=True)
    torchrun = venv / "bin" / "torchrun"
    torchrun.write_text(f"#!{python}\n" + "".join(lines[1:]))
    torchrun.chmod(0o755)
    check = subprocess.run(
        [str(python), "-c", "import torch, logtriage; print(torch.__file__)"],
        cwd=root, capture_output=True, text=True, timeout=120,
    )
    if check.returncode != 0 or not check.stdout.strip().startswith(str(venv)):
        return None
    return Workspace(root, python, torchrun, neutral=True)
