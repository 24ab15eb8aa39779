"""`pip install .` (not only editable) must ship the catalog."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from tests.conftest import ROOT


def test_wheel_contains_the_catalog(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    wheel = next(tmp_path.glob("logtriage-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    rules = [n for n in names if n.startswith("logtriage/_builtin_patterns/") and n.endswith(".toml")]
    shipped = {p.relative_to(ROOT / "patterns").as_posix() for p in (ROOT / "patterns").rglob("*.toml")}
    assert {n.split("_builtin_patterns/", 1)[1] for n in rules} == shipped
    assert "logtriage/cli.py" in names
    # the `triage` command is cli.entry (it leaves at once after Ctrl-C), which must exist
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "triage = logtriage.cli:entry" in zipfile.ZipFile(wheel).read(entry_points).decode()
    from logtriage import cli
    assert callable(cli.entry)
