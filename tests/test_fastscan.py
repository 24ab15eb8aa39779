"""The fast scan gives exactly the straightforward scan's report (issue 6), on every sample log
and on generated logs of every style and failure kind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from logtriage.api import TriageOptions, triage
from logtriage.regress.cases import find_cases
from tests.conftest import ROOT, SAMPLES

CASES = find_cases(SAMPLES)


def _both(path: str) -> tuple[dict, dict]:
    exact = triage([path], TriageOptions(engine="exact")).to_dict()
    fast = triage([path], TriageOptions(engine="fast", workers=0)).to_dict()
    return exact, fast


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fast_scan_report_equals_exact_on_samples(case):
    exact, fast = _both(str(case.log))
    assert fast == exact


@pytest.mark.parametrize("style", ["plain", "tee", "srun"])
@pytest.mark.parametrize("failure", ["none", "oom", "exception", "sigkill", "timeout"])
def test_fast_scan_report_equals_exact_on_generated_logs(tmp_path, style, failure):
    log = tmp_path / "gen.log"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generate.py"), "--ranks", "16", "--size", "2M",
                    "--seed", "11", "--style", style, "--failure", failure, "--out", str(log)],
                   check=True, capture_output=True, timeout=300)
    exact, fast = _both(str(log))
    assert fast == exact
    assert exact["input_lines"] == sum(s["lines"] for s in exact["streams"])


def test_fast_scan_with_worker_processes(tmp_path):
    log = tmp_path / "gen.log"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generate.py"), "--ranks", "8", "--size", "2M",
                    "--seed", "3", "--failure", "exception", "--out", str(log)], check=True, capture_output=True)
    exact = triage([str(log)], TriageOptions(engine="exact")).to_dict()
    pooled = triage([str(log)], TriageOptions(engine="fast", workers=2)).to_dict()
    assert pooled == exact


def test_fast_scan_stdin_and_gzip(tmp_path):
    import gzip
    data = (SAMPLES / "cpu" / "rank_exception__np4.log").read_bytes() * 3
    gz = tmp_path / "x.log.gz"
    gz.write_bytes(gzip.compress(data))
    assert triage([str(gz)], TriageOptions(engine="fast", workers=2)).to_dict() == \
        triage([str(gz)], TriageOptions(engine="exact")).to_dict()
    piped = subprocess.run([sys.executable, "-c", "import sys, orjson; from logtriage.api import *; "
                            "print(orjson.dumps(triage(['-'], TriageOptions(engine=sys.argv[1])).to_dict()).decode())",
                            "fast"], input=data, capture_output=True, check=True)
    exact = subprocess.run([sys.executable, "-c", "import sys, orjson; from logtriage.api import *; "
                            "print(orjson.dumps(triage(['-'], TriageOptions(engine=sys.argv[1])).to_dict()).decode())",
                            "exact"], input=data, capture_output=True, check=True)
    assert piped.stdout == exact.stdout
