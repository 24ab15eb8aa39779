"""The fast scan gives exactly the straightforward scan's report (issue 6), on every sample log
and on generated logs of every style and failure kind."""

from __future__ import annotations

import subprocess
import sys
from unittest import mock

import pytest

from logtriage.api import TriageOptions, triage
from logtriage.demux.clean import clean, decode
from logtriage.demux.prefixes import Dialect
from logtriage.fastscan import driver
from logtriage.regress.cases import find_cases
from tests.conftest import ROOT, SAMPLES

CASES = find_cases(SAMPLES)


def _both(path: str) -> tuple[dict, dict]:
    exact = triage([path], TriageOptions(engine="exact")).to_dict()
    fast, _ = _fast(path)
    return exact, fast


def _fast(path: str) -> tuple[dict, list[str]]:
    """The fast engine's report, and how it read each file: by "ranges" (its own code) or handed
    to the "exact" scanner (launcher prefixes the compiled classifier does not parse)."""
    taken: list[str] = []
    with mock.patch.object(driver, "_file_ranges", side_effect=_record(taken, "ranges", driver._file_ranges)), \
            mock.patch.object(driver, "_exact", side_effect=_record(taken, "exact", driver._exact)):
        report = triage([path], TriageOptions(engine="fast", workers=0)).to_dict()
    return report, taken


def _record(taken: list[str], name: str, real):
    def call(*args, **kwargs):
        taken.append(name)
        return real(*args, **kwargs)
    return call


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fast_scan_report_equals_exact_on_samples(case):
    exact, fast = _both(str(case.log))
    assert fast == exact


def test_a_plain_line_of_a_stream_whose_traceback_waits_ends_it_on_both_engines():
    """torchrun --tee 3, 4 ranks (cpu_adhoc 374th batch): rank 2's `Traceback` header (line 8) is followed by other
    ranks' lines and by rank 2's own stdout line `rank 2/4 up` (line 11) before its frames: that plain line ends the
    waiting traceback, so the frames from line 13 are a traceback of their own on the fast engine too."""
    exact, fast = _both(str(SAMPLES / "cpu_adhoc" / "wavh_badqc_np4_r2_tee.log"))
    assert [e["line"] for e in fast["root_cause"]["evidence"]][:2] == [13, 14]
    assert fast == exact


def test_fast_scan_reads_plain_files_itself():
    """Equality alone would pass if the fast engine handed every file to the exact scanner. Every fourth
    sample (over 1,200 logs of every folder): the equality test above already runs both engines on all of them."""
    paths = {c.name: c.log for c in CASES[::4] if c.log.is_file()}
    taken = {name: _fast(str(log))[1] for name, log in paths.items()}
    handed = sorted(name for name, how in taken.items() if how != ["ranges"])
    assert len(paths) - len(handed) >= 300
    for name in handed:   # only logs whose prefixes (srun tasks as nodes, hosts, a CI clock, pytest's) it leaves alone
        dialect = Dialect.detect(clean(decode(raw)) for raw in paths[name].read_bytes().split(b"\n")[:4000])
        assert taken[name] == ["exact"] and dialect.exact_only, name


@pytest.mark.parametrize("style", ["plain", "tee", "srun"])
@pytest.mark.parametrize("failure", ["none", "oom", "exception", "sigkill", "timeout"])
def test_fast_scan_report_equals_exact_on_generated_logs(tmp_path, style, failure):
    log = tmp_path / "gen.log"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generate.py"), "--ranks", "16", "--size", "2M",
                    "--seed", "11", "--style", style, "--failure", failure, "--out", str(log)],
                   check=True, capture_output=True, timeout=300)
    exact = triage([str(log)], TriageOptions(engine="exact")).to_dict()
    fast, taken = _fast(str(log))
    assert fast == exact
    assert exact["input_lines"] == sum(s["lines"] for s in exact["streams"])
    dialect = Dialect.detect(clean(decode(raw)) for raw in log.read_bytes().split(b"\n")[:4000])
    assert taken == (["exact"] if dialect.srun_nodes else ["ranges"])


@pytest.mark.parametrize("closing", [" ", ": "])
def test_fast_scan_reads_collector_stamps_itself(tmp_path, closing):
    """`kubectl logs --timestamps` / `docker logs -t` put an RFC 3339 time before every line (some
    consoles close it with `: `): the compiled classifier strips it as the demuxer does."""
    plain = tmp_path / "plain.log"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generate.py"), "--ranks", "8", "--size", "1M",
                    "--seed", "5", "--style", "tee", "--failure", "exception", "--out", str(plain)],
                   check=True, capture_output=True, timeout=300)
    lines = plain.read_bytes().split(b"\n")
    stamped = b"\n".join(b"2024-05-01T10:%02d:%02d.%09dZ%s" % (i // 60 % 60, i % 60, i * 7919 % 10**9, closing.encode())
                         + line if line else line for i, line in enumerate(lines))
    log = tmp_path / "stamped.log"
    log.write_bytes(stamped)
    exact = triage([str(log)], TriageOptions(engine="exact")).to_dict()
    fast, taken = _fast(str(log))
    assert fast == exact and taken == ["ranges"]
    assert exact["root_cause"] == triage([str(plain)], TriageOptions(engine="exact")).to_dict()["root_cause"] | {
        "source": str(log), "evidence": exact["root_cause"]["evidence"]}


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


def test_prefilter_finds_every_line_a_rule_matches_with_either_engine(monkeypatch):
    """The prefilter's candidates hold every line the exact matcher finds a rule on (the fast
    path relies on it), with Hyperscan and with the RE2 fallback."""
    import numpy as np

    from logtriage.api import get_catalog
    from logtriage.catalog.matcher import Matcher
    from logtriage.demux.clean import clean, decode
    from logtriage.demux.prefixes import Dialect, strip_prefixes
    from logtriage.fastscan import prefilter as P

    matcher = Matcher(get_catalog())
    engines = [P.Prefilter(matcher.rules)]
    monkeypatch.setattr(P, "_hyperscan_database", lambda *a: None)
    engines.append(P.Prefilter(matcher.rules))
    assert engines[1].hyperscan is None
    checked = 0
    for case in CASES[::3]:
        if not case.log.is_file():
            continue
        data = case.log.read_bytes()
        raw_lines = data.split(b"\n")
        starts = np.cumsum([0] + [len(r) + 1 for r in raw_lines[:-1]]).astype(np.int64)
        for engine in engines:
            found = set(engine.candidate_lines(data, starts).tolist())
            for number, raw in enumerate(raw_lines):
                text = clean(decode(raw))
                if matcher.match(text) or matcher.match(strip_prefixes(text, Dialect()).text):
                    assert number in found, (case.name, number + 1, engine.hyperscan is not None)
                    checked += 1
    assert checked > 100


@pytest.mark.parametrize("chunk, tail", [(4096, 64), (1000, 7), (65536, 4096)])
def test_fast_scan_chunk_boundaries(tmp_path, monkeypatch, chunk, tail):
    """Lines cut by range boundaries, and lines longer than a whole range, land exactly where
    the exact path puts them."""
    from logtriage.fastscan import driver
    monkeypatch.setattr(driver, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(driver, "RANGE_TAIL", tail)
    data = (SAMPLES / "cpu" / "rank_exception__np4.log").read_bytes()
    data += b"[rank 3] step 9 " + b"x" * 9000 + b"\n" + (SAMPLES / "cpu" / "healthy__np4.log").read_bytes()
    data += b"[rank 1] step 11 no newline at the end"
    log = tmp_path / "cut.log"
    log.write_bytes(data)
    exact = triage([str(log)], TriageOptions(engine="exact")).to_dict()
    for workers in (0, 2):
        assert triage([str(log)], TriageOptions(engine="fast", workers=workers)).to_dict() == exact


def test_the_builtin_catalog_builds_a_hyperscan_prefilter_where_hyperscan_is_installed():
    # One pattern Hyperscan rejects (a `\x{2013}` escape above \xFF did, unnoticed, for several
    # stops) silently sends every scan to the RE2 alternation, several times slower on 1 GB.
    pytest.importorskip("hyperscan")
    from logtriage.api import get_catalog
    from logtriage.catalog.matcher import Matcher
    from logtriage.fastscan.prefilter import Prefilter

    assert Prefilter(Matcher(get_catalog()).rules).hyperscan is not None


@pytest.mark.parametrize("style", ["plain", "tee"])
def test_the_prefilter_leaves_a_healthy_logs_lines_to_the_byte_scan(tmp_path, style):
    """A pattern whose literals are common words (stop 27's `skipp(?:ing|ed) (?:bad )?(?:sample|file|item)`
    shape) sends ordinary progress lines to the exact path: the 1 GB benchmark went from 4 s to
    27.6 s with no test failing. On a healthy generated log the candidates stay a small share of
    the lines (0.4 % at stop 28's start; 3.6 % with that pattern)."""
    import numpy as np

    from logtriage.api import get_catalog
    from logtriage.catalog.matcher import Matcher
    from logtriage.fastscan.prefilter import Prefilter

    log = tmp_path / "healthy.log"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generate.py"), "--ranks", "16", "--size", "4M",
                    "--seed", "11", "--style", style, "--failure", "none", "--out", str(log)],
                   check=True, capture_output=True, timeout=300)
    data = log.read_bytes()
    raw_lines = data.split(b"\n")
    starts = np.cumsum([0] + [len(r) + 1 for r in raw_lines[:-1]]).astype(np.int64)
    candidates = Prefilter(Matcher(get_catalog()).rules).candidate_lines(data, starts)
    assert len(candidates) / len(raw_lines) < 0.015, (
        f"{len(candidates)} of {len(raw_lines)} lines are prefilter candidates: a rule's pattern likely "
        "requires only common words (see prefilter.required_atoms)")


def test_the_prefilter_finds_every_rules_example_lines_with_either_engine(monkeypatch):
    """Every example line a rule must match is a candidate of both prefilters: Hyperscan reads a
    pattern as bytes, so a character outside ASCII in a class or before a quantifier (`值?`) would
    drop lines that RE2 and the exact matcher find."""
    import numpy as np

    from logtriage.api import get_catalog
    from logtriage.catalog.matcher import Matcher
    from logtriage.fastscan import prefilter as P

    matcher = Matcher(get_catalog())
    engines = [P.Prefilter(matcher.rules)]
    monkeypatch.setattr(P, "_hyperscan_database", lambda *a: None)
    engines.append(P.Prefilter(matcher.rules))
    lines = [example.line for compiled in matcher.rules for example in compiled.rule.examples]
    data = "\n".join(lines).encode() + b"\n"
    starts = np.cumsum([0] + [len(line.encode()) + 1 for line in lines[:-1]]).astype(np.int64)
    for engine in engines:
        found = set(engine.candidate_lines(data, starts).tolist())
        missed = [lines[i] for i in range(len(lines)) if i not in found]
        assert not missed, (engine.hyperscan is not None, missed[:5])
