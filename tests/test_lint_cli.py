"""`triage lint` end to end: exit codes, suppression comments, text/JSON/SARIF output."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from logtriage.cli import main

SCHEMA = Path(__file__).parent / "lint_fixtures" / "sarif" / "sarif-schema-2.1.0.json"

BUGGY = '''import torch
import torch.distributed as dist


def step(metric, rank):
    if rank == 0:
        dist.all_reduce(metric)
'''
WARNING_ONLY = '''import torch.distributed as dist

dist.init_process_group("gloo")
'''
CLEAN = '''import datetime
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
'''


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def lint(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["lint", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_text_output_and_exit_code_on_error(tmp_path, capsys) -> None:
    path = write(tmp_path, "train.py", BUGGY)
    code, out, _ = lint(capsys, path)
    assert code == 1
    first = out.splitlines()[0]
    assert re.fullmatch(rf"{re.escape(path)}:7:9: DDP101 `all_reduce` runs inside `if rank == 0:` .*", first)
    assert out.splitlines()[-1] == "Found 1 finding(s) (1 error) in 1 file(s)."


def test_fail_on_threshold(tmp_path, capsys) -> None:
    path = write(tmp_path, "setup.py", WARNING_ONLY)
    assert lint(capsys, path)[0] == 0                              # default: fail on error only
    assert lint(capsys, path, "--fail-on", "warning")[0] == 1
    assert lint(capsys, path, "--fail-on", "info")[0] == 1
    clean = write(tmp_path, "clean.py", CLEAN)
    code, out, _ = lint(capsys, clean, "--fail-on", "info")
    assert code == 0 and out == "No findings in 1 file(s).\n"


def test_usage_and_input_errors(tmp_path, capsys) -> None:
    assert lint(capsys, str(tmp_path / "missing.py"))[0] == 3
    code, _, err = lint(capsys, str(tmp_path), "--select", "XYZ999")
    assert code == 2 and "unknown lint rule" in err
    assert lint(capsys, str(tmp_path), "--fail-on", "fatal")[0] == 2


def test_select_and_ignore(tmp_path, capsys) -> None:
    path = write(tmp_path, "both.py", BUGGY + '\ndist.init_process_group("gloo")\n')
    _, out, _ = lint(capsys, path, "--select", "PG")
    assert " PG201 " in out and " DDP101 " not in out
    code, out, _ = lint(capsys, path, "--ignore", "DDP101,init-without-timeout")
    assert code == 0 and out.startswith("No findings")


def test_suppression_comments(tmp_path, capsys) -> None:
    text = '''import torch.distributed as dist


def f(t, rank):
    if rank == 0:
        dist.all_reduce(t)  # triage: ignore[DDP101]
    if rank == 0:
        dist.barrier()  # triage: ignore
    if rank == 0:
        dist.broadcast(t, 0)  # triage: ignore[PG201]
    if rank == 0:
        dist.all_gather([t], t); s = "# triage: ignore"
'''
    path = write(tmp_path, "s.py", text)
    _, out, _ = lint(capsys, path, "--format", "json")
    lines = sorted(f["line"] for f in json.loads(out)["findings"])
    assert lines == [10, 12]          # another rule's code and a string do not silence
    whole = write(tmp_path, "w.py", "# triage: ignore-file[collective-in-rank-branch]\n" + text)
    _, out, _ = lint(capsys, whole, "--format", "json")
    assert json.loads(out)["findings"] == []


def test_template_suppression(tmp_path, capsys) -> None:
    text = "#!/bin/bash\n# triage: ignore-file[LNC401]\ntorchrun --nproc-per-node 2 train.py  # triage: ignore[LNC402]\n"
    path = write(tmp_path, "run.sh", text)
    assert lint(capsys, path, "--fail-on", "info")[1].startswith("No findings")


def test_json_output(tmp_path, capsys) -> None:
    path = write(tmp_path, "train.py", BUGGY)
    _, out, _ = lint(capsys, path, "--format", "json")
    data = json.loads(out)
    assert data["files_checked"] == 1 and data["summary"] == {"error": 1, "warning": 0, "info": 0}
    finding = data["findings"][0]
    assert (finding["rule"], finding["name"], finding["severity"], finding["line"], finding["col"]) == (
        "DDP101", "collective-in-rank-branch", "error", 7, 9)


def validate_sarif(text: str) -> dict:
    log = json.loads(text)
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft4Validator(schema, format_checker=jsonschema.FormatChecker()).validate(log)
    return log


def test_sarif_validates_against_the_official_schema(tmp_path, capsys) -> None:
    write(tmp_path, "train.py", BUGGY)
    write(tmp_path, "run job.sh", "#!/bin/bash\nsrun python train.py\n")
    write(tmp_path, "broken.py", "def f(:\n")
    code, out, err = lint(capsys, str(tmp_path), "--format", "sarif")
    assert code == 1 and "broken.py:1: cannot parse" in err
    run = validate_sarif(out)["runs"][0]
    rules = run["tool"]["driver"]["rules"]
    assert len(rules) == 14 and rules[run["results"][0]["ruleIndex"]]["id"] == run["results"][0]["ruleId"]
    levels = sorted((r["ruleId"], r["level"]) for r in run["results"])
    assert levels == [("DDP101", "error"), ("LNC401", "warning"), ("LNC402", "warning")]
    uris = {r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for r in run["results"]}
    assert any(u.endswith("run%20job.sh") for u in uris)
    assert run["invocations"][0]["toolExecutionNotifications"][0]["message"]["text"].startswith("cannot parse")


def test_sarif_with_no_findings_validates(tmp_path, capsys) -> None:
    path = write(tmp_path, "clean.py", CLEAN)
    code, out, _ = lint(capsys, path, "--format", "sarif", "--select", "PG201")
    log = validate_sarif(out)
    assert code == 0 and log["runs"][0]["results"] == []


def test_output_file_and_rule_list(tmp_path, capsys) -> None:
    path = write(tmp_path, "train.py", BUGGY)
    report = tmp_path / "lint.sarif"
    code, out, _ = lint(capsys, path, "--format", "sarif", "-o", str(report))
    assert code == 1 and out == "" and validate_sarif(report.read_text())["version"] == "2.1.0"
    code, out, _ = lint(capsys, "--list-rules")
    assert code == 0 and len(out.splitlines()) == 14 and out.startswith("CKP301  error")


@pytest.mark.parametrize("name", ["notes.txt", "data.json"])
def test_other_files_are_not_linted(tmp_path, capsys, name) -> None:
    write(tmp_path, name, "torchrun train.py\n")
    assert lint(capsys, str(tmp_path))[1] == "No findings in 0 file(s).\n"


def test_linting_imports_neither_torch_nor_the_linted_code(tmp_path) -> None:
    marker = tmp_path / "ran.txt"
    write(tmp_path, "side_effect.py", f"open({str(marker)!r}, 'w').write('imported')\n" + BUGGY)
    code = ("import sys; from logtriage.lint import lint_paths; "
            f"r = lint_paths([{str(tmp_path)!r}]); "
            "print(len(r.findings), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent.parent).stdout
    assert out.split() == ["1", "False"] and not marker.exists()


def test_unreadable_files_are_problems_not_crashes(tmp_path, capsys) -> None:
    (tmp_path / "latin1.py").write_bytes(b"x = '\xe9'\n")
    write(tmp_path, "ok.py", BUGGY)
    code, out, err = lint(capsys, str(tmp_path))
    assert code == 1 and "latin1.py:0: cannot read" in err and out.endswith("in 1 file(s).\n")
